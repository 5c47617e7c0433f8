"""The `compile` backend's torch.compile: regional compilation of the eager loop.

* The DiTs: each transformer block's two regions (`sdvg.models.dit_block`: everything before the
  self-attention, everything after it) compiled once and reused by every layer of both DiTs (one
  compilation per region and shape, as diffusers' `compile_repeated_blocks`; the layers' weights are
  inputs of the graph, not constants). The KV cache and the attention over it run between the regions,
  so a region's shapes are the block's own tokens only: the growing cache never recompiles anything.
  Shapes are static (`dynamic=False`): one graph per token count a role forwards (a block, a recompute
  context, a start frame's frames), a handful per video, compiled on first use and kept.
* The VAE decode: the steady-state frame through `FastVAEDecode` (channels-last, cudnn.benchmark, the
  frame step compiled with static shapes).
* The reward model: its forward over a block's frames (`RewardStep`, one graph per frame count).

Not bitwise the eager path: inductor fuses and reorders the fp32 arithmetic. The difference stays within
`COMPILE_TOLERANCE` (tests/test_compile.py). The compile time is reported per video (`compile` in the
statistics): the seconds dynamo and inductor spent compiling during it, and the FX-graph cache's hits and
misses (a persistent inductor cache, `cache_dir`, turns a cold compilation into cache hits)."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg.models.dit_block import BlockRegions, after_attention, before_attention
from sdvg.options import COMPILE_MODES, COMPILERS

# max |compiled - eager| relative to max |eager| of a DiT forward's output, per dtype (inductor's fused fp32
# arithmetic rounds differently; bf16 carries ~3 significant digits through 40 layers)
COMPILE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
RECOMPILE_LIMIT = 64  # graphs per region: every token count of both DiTs (dynamo's default of 8 is too few)

log = logging.getLogger(__name__)


class CompileSettingsError(ValueError):
    """A compile setting has a value it cannot take; the message names it and the fix."""


@dataclass(frozen=True)
class CompileSettings:
    """How the `compile` backend compiles (`from_preset(..., compile_mode=, compile_cache=)`, CLI
    `--compile-mode`, `--compile-cache`). `cache_dir`: inductor's persistent cache folder
    (TORCHINDUCTOR_CACHE_DIR, process-wide once a compile backend is made); None keeps torch's."""

    mode: str = "default"
    compiler: str = "inductor"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            why = (" (it captures CUDA graphs of each region; for graphs use cuda_graphs=True with backend eager)"
                   if self.mode in ("reduce-overhead", "max-autotune") else "")
            raise CompileSettingsError(f"unknown compile_mode {self.mode!r}{why}; choose one of "
                                       f"{', '.join(COMPILE_MODES)} (--compile-mode)")
        if self.compiler not in COMPILERS:
            raise CompileSettingsError(f"unknown compiler {self.compiler!r}; choose one of {', '.join(COMPILERS)}")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", str(check_cache_dir(self.cache_dir)))

    def compile(self, fn, part: str = "other"):
        """`fn` through torch.compile with these settings, static shapes, as a `CompiledPart` named `part`."""
        if self.compiler != "inductor":
            return CompiledPart(part, torch.compile(fn, backend=self.compiler, dynamic=False))
        return CompiledPart(part, torch.compile(fn, mode=self.mode, dynamic=False))

    def activate(self) -> None:
        """Process-wide settings a compile backend needs, set once it is made: the inductor cache folder and a
        recompile limit that fits every token count of both DiTs."""
        if self.cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):  # the name moved between torch versions
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))


def check_cache_dir(path) -> Path:
    """An inductor cache folder that exists (made here if missing) and can be written, or a
    CompileSettingsError naming it and the fix."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CompileSettingsError(f"compile_cache must be a folder path, got {path!r}")
    folder = Path(path).expanduser()
    try:
        if folder.exists() and not folder.is_dir():
            raise CompileSettingsError(f"compile_cache {str(folder)!r} is a file, not a folder; give a folder for "
                                       "inductor's cache (--compile-cache DIR)")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".sdvg-write-check-"):
            pass
    except CompileSettingsError:
        raise
    except OSError as exc:
        raise CompileSettingsError(f"compile_cache {str(folder)!r} cannot be written ({exc.strerror or exc}); give a "
                                   "folder this user can write (--compile-cache DIR), or leave it unset for torch's "
                                   "default cache") from None
    return folder.resolve()


def compiled_regions(settings: CompileSettings) -> BlockRegions:
    return BlockRegions(settings.compile(before_attention, "dit.before_attention"),
                        settings.compile(after_attention, "dit.after_attention"))


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


_PARTS: dict[str, list] = {}  # part -> [seconds of the calls that compiled, graphs], process-wide
_PARTS_LOCK = threading.Lock()


class CompiledPart:
    """A compiled callable that times each call in which torch.compile compiled a graph, per part (the DiT
    regions, the VAE step, the reward step), and logs it as it happens (INFO, this module's logger): a
    cold start's cost by part, even when a time box ends it. The seconds are the wall time of those calls
    (tracing, inductor, the first run); two threads compiling at once may each see the other's graph."""

    def __init__(self, part: str, fn):
        self.part, self.fn = part, fn

    def __call__(self, *args, **kwargs):
        before, t0 = _graphs_compiled(), time.perf_counter()
        out = self.fn(*args, **kwargs)
        made = _graphs_compiled() - before
        if made:
            seconds = time.perf_counter() - t0
            with _PARTS_LOCK:
                held = _PARTS.setdefault(self.part, [0.0, 0])
                held[0] += seconds
                held[1] += made
            shape = next((list(a.shape) for a in args if isinstance(a, torch.Tensor)), None)
            log.info("compiled %s (first tensor input %s): %d graph(s) in %.1f s", self.part, shape, made, seconds)
        return out


def parts_compiled() -> dict[str, tuple[float, int]]:
    """part -> (seconds of the calls that compiled, graphs) so far in this process."""
    with _PARTS_LOCK:
        return {k: (v[0], v[1]) for k, v in _PARTS.items()}


class CompileClock:
    """What torch.compile did since it was made: seconds compiling (dynamo's `_compile.compile_inner`
    timer, every thread), graphs compiled, and inductor's FX-graph cache hits and misses."""

    def __init__(self, settings: CompileSettings):
        self.settings = settings
        self._start = self._read()

    @staticmethod
    def _read() -> dict:
        from torch._dynamo.utils import compilation_time_metrics, counters

        return {"compile_s": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
                "graphs": counters["stats"]["unique_graphs"],
                "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                "cache_misses": counters["inductor"]["fxgraph_cache_miss"], "by_part": parts_compiled()}

    def since(self) -> dict:
        now = self._read()
        out = {k: now[k] - self._start[k] for k in now if k != "by_part"}
        out["compile_s"] = round(out["compile_s"], 3)
        start = self._start["by_part"]
        out["by_part"] = {part: {"seconds": round(s - start.get(part, (0.0, 0))[0], 3),
                                 "graphs": g - start.get(part, (0.0, 0))[1]}
                          for part, (s, g) in now["by_part"].items() if g > start.get(part, (0.0, 0))[1]}
        return {"mode": self.settings.mode, "compiler": self.settings.compiler, "cache_dir": inductor_cache_dir(),
                **out}


def inductor_cache_dir() -> str | None:
    """The folder inductor caches compiled kernels and graphs in (TORCHINDUCTOR_CACHE_DIR, or torch's default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return str(cache_dir())
    except (ImportError, AttributeError):
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
