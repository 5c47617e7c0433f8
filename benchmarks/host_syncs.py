"""Host syncs and kernel launches per block, before (`cuda_graphs=False`, main's path) and after
(`cuda_graphs=True`; then also `stage_timing="events"`, then also `fast_vae=True`), counted on any
device; on a GPU the wall time per block as well.

    python benchmarks/host_syncs.py --preset tiny --variants eager,cuda_graphs,events,fast_vae \
        --out results/host-syncs-cpu
    python benchmarks/host_syncs.py --preset real-size --device cuda:0 --out results/host-syncs-h200

What is counted during each video (after one warm-up video per variant, which also captures the
graphs), divided by the number of blocks:
  launches        aten operators that run a kernel (views, `empty*` and other metadata-only operators
                  excluded); on the CPU a graph replay of the stand-in counts as one launch, as a CUDA
                  graph replay is one launch;
  scalar_reads    `_local_scalar_dense` (`.item()`, `bool(t)`, `float(t)`: the stage guard's finite check,
                  the router) and `.tolist()` / `.cpu()` / `.numpy()`: each waits for the device;
  stage_syncs     `torch.cuda.synchronize` / `Stream.synchronize` / `Event.synchronize` and the loops' own
                  per-stage waits (the stage calls' `StageCalls._wait`), counted even on
                  the CPU where they return at once (`stage_timing="events"` makes none; its one wait per
                  recorded event pair at the end of the video is an `Event.synchronize`, on CUDA only);
  blocking_moves  `.to(device)` / `.cuda()` to another device without `non_blocking`: a host sync (the
                  CPU-drawn noise, the RoPE tables of each eager forward, latents read back); always 0
                  on the CPU, where nothing crosses a device.
  host_syncs      what would wait for the device on a GPU, found on any device (the CPU included) by
                  tagging each tensor as host-made (a factory call without `device=`, a tensor derived
                  from host tensors only, a `.cpu()` / `.to("cpu")` result, and the components' host
                  tables: the DiTs' float64 RoPE angles, the VAE's latent statistics) or device-resident
                  (everything else): a blocking `.to(device)` / `.cuda()` / `copy_` of a host tensor
                  into device memory, and a scalar read (`.item()`, `int(t)`, `bool(t)`) or host read
                  (`.cpu()`, `.tolist()`, `.numpy()`, `.to("cpu")`) of a device tensor; a host tensor's
                  own `.item()` (the router's CPU draw) is no sync and not counted here;
  async_copies    `.to(device, non_blocking=True)` of a host tensor (from pinned memory on CUDA): no host
                  sync;
  per forward     host_syncs divided by the DiT forwards of the video (`<role>_forwards`).
Each host sync is also listed by its call site (the innermost sdvg frames) with its count per block and
the reason it remains (`REASONS`). Writes results.json (with provenance) and results.md after each
variant.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance, provenance_line  # noqa: E402
from sdvg.config import get_preset  # noqa: E402
from sdvg.generation import graphs as graphs_mod, role_model  # noqa: E402
from sdvg.generation.calls import StageCalls  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from sdvg.pipeline import SpeculativeVideoPipeline  # noqa: E402

PROMPT = "a red fox running through fresh snow at dawn, cinematic"
SEED = 0
_NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "_local_scalar_dense", "set_", "resize_", "is_same_size", "record_stream")
_READS = {"tolist", "cpu", "numpy"}
# --variants: name -> (label, options); each after `eager` adds its change to the one before
VARIANTS = {"eager": ("before (eager)", {}),
            "cuda_graphs": ("after (cuda_graphs)", {"cuda_graphs": True}),
            "events": ("after (cuda_graphs, stage_timing events)", {"cuda_graphs": True, "stage_timing": "events"}),
            "fast_vae": ("after (cuda_graphs, events, fast_vae)",
                         {"cuda_graphs": True, "stage_timing": "events", "fast_vae": True})}


# (substrings that one frame of a call site all contain) -> why the host sync is there; the innermost frame
# that matches decides
REASONS = {
    ("rope_cos_sin",): "RoPE tables built in float64 on the host and copied per forward (now kept on the "
                       "device per position: sdvg/models/device_constants.py)",
    ("vae.py", " decode"): "the VAE's latent statistics copied per decode (now kept on the device)",
    ("vae.py", " encode_frame"): "the VAE's latent statistics copied per re-encode (now kept on the device)",
    ("noise.py",): "noise drawn on the host and copied with a blocking .to (now pinned, non-blocking)",
    ("role_model.py", " denoise"): "the block noise copied with a blocking .to (now pinned, non-blocking)",
    ("role_model.py", " rebuild_context"): "the recompute context's mask built on the host (now: none for one "
                                           "group, else kept on the device)",
    ("dit.py", " forward"): "an attention mask or the active tokens copied per forward",
    ("check_active",): "early exit: the active tokens' bounds read on the host (a data-dependent set)",
    ("early_exit",): "early exit: the verifier's data-dependent decision read on the host",
    ("kv_cache",): "sparse KV write: token positions read on the host per layer (now built once on the device)",
    ("engines/modules.py", "visible_cache_index"): "DiT engines: the visible-cache index copied per forward (now "
                                                   "kept on the device)",
    ("to_uint8_frames",): "the finished block's frames handed to the caller on the host: the output itself, "
                          "once per block",
    (" emit",): "the finished block's latents handed to the caller on the host: the output itself, once per "
                "block",
    ("reward.py", "check_frames"): "ImageReward's input check (pixels in range) read on the host, per scored "
                                   "block",
    ("reward.py",): "the reward score read on the host to compare with tau, per scored block",
    ("nonfinite_counts",): "the stage guard's finite check of a stage output (one scalar read per draft, "
                           "target and decode output; the guard's own issue)",
    ("guard.py",): "the stage guard reads a stage output's check on the host (the guard's own issue)",
    ("routers.py",): "the router's decision read on the host",
}


class _IdSet:
    """A set of tensors by identity that does not keep them alive (WeakSet compares tensors by value)."""

    def __init__(self):
        self._refs: dict = {}

    def add(self, t) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, key=key, refs=self._refs: refs.pop(key, None))

    def discard(self, t) -> None:
        ref = self._refs.get(id(t))
        if ref is not None and ref() is t:
            del self._refs[id(t)]

    def __contains__(self, t) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class Count:
    def __init__(self):
        self.c = Counter()
        self.paused = 0
        self.host = _IdSet()  # tensors made on the host (see the module docstring)
        self.sites = Counter()  # (kind, call site) -> host syncs

    def is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def sync(self, kind: str) -> None:
        if self.paused:
            return
        self.c["host_syncs"] += 1
        self.sites[(kind, _site())] += 1


def _site() -> str:
    """The innermost two sdvg frames of the current stack (file:line function)."""
    frame, out = sys._getframe(2), []
    while frame is not None and len(out) < 2:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/sdvg/" in name and "/benchmarks/" not in name and "device_constants" not in name:
            out.append(f"{name.split('/sdvg/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(out) or "(outside sdvg)"


def _tensors(tree):
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Ops(TorchDispatchMode):
    def __init__(self, count: Count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        count = self.count
        inputs = _tensors((args, kwargs))
        if not count.paused:
            if name == "_local_scalar_dense":
                count.c["scalar_reads"] += 1
                if not count.is_host(inputs[0]):
                    count.sync("scalar read of a device tensor")
            elif not func.is_view and name not in _NO_KERNEL:
                count.c["launches"] += 1
            if name == "copy_" and len(inputs) >= 2 and not count.is_host(inputs[0]) and count.is_host(inputs[1]) \
                    and not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking"):
                count.sync("blocking copy_ of a host tensor into device memory")
        out = func(*args, **kwargs)
        if inputs and all(count.is_host(t) for t in inputs):  # derived from host tensors only: on the host
            ids = {id(t) for t in inputs}
            for t in _tensors(out):
                if id(t) not in ids:
                    count.host.add(t)
        return out


class _Calls(TorchFunctionMode):
    def __init__(self, count: Count):
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        count = self.count
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not count.paused:
            if name in _READS:
                count.c["scalar_reads"] += 1
            elif name in ("to", "cuda") and not kwargs.get("non_blocking") and _crosses(args, kwargs, name):
                count.c["blocking_moves"] += 1
        out = func(*args, **kwargs)
        if name in _FACTORIES and "device" not in kwargs and isinstance(out, torch.Tensor):
            count.host.add(out)  # made on the host
        elif src is not None and isinstance(out, torch.Tensor):
            where = _destination(args, kwargs, name)
            if where == "host":
                if not count.is_host(src):
                    count.sync(f"{name}() of a device tensor")
                out = _alias(out, src)
                count.host.add(out)
            elif where == "device" and count.is_host(src):
                if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
                    if not count.paused:
                        count.c["async_copies"] += 1
                else:
                    count.sync(f"blocking .{name}(device) of a host tensor")
                out = _alias(out, src)
                count.host.discard(out)
        elif src is not None and name in ("tolist", "numpy") and not count.is_host(src):
            count.sync(f"{name}() of a device tensor")
        return out


_FACTORIES = {"tensor", "as_tensor", "randn", "rand", "randint", "zeros", "ones", "full", "empty", "arange", "linspace"}


def _alias(out, src):
    """`out`, a tensor object of its own (the CPU's no-op `.to` returns its source) so that its tag can differ."""
    if out is not src:
        return out
    with torch._C.DisableTorchFunction():
        return out.detach()


def _destination(args, kwargs, name):
    """"device" (`.to(<torch.device or tensor>)` / `.cuda()`), "host" (`.cpu()` / `.to("cpu")`) or None."""
    if name == "cuda":
        return "device"
    if name == "cpu":
        return "host"
    if name != "to":
        return None
    dest = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str, torch.Tensor))), None))
    if isinstance(dest, str):
        return "host" if dest == "cpu" else "device"
    if isinstance(dest, (torch.device, torch.Tensor)):
        return "device"
    return None


def _crosses(args, kwargs, name) -> bool:
    """Whether `.to(...)` / `.cuda()` copies its tensor to another device."""
    src = args[0]
    if not isinstance(src, torch.Tensor):
        return False
    if name == "cuda":
        return src.device.type != "cuda"
    dest = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
    if isinstance(dest, str):
        try:
            dest = torch.device(dest)
        except RuntimeError:
            return False
    if dest is None:
        return False
    return dest.type != src.device.type or (dest.index is not None and dest.index != src.device.index)


def counting(count: Count):
    """Patches that count the per-stage waits and make a graph replay count as one launch."""
    patches = []

    def patch(obj, name, wrapper):
        original = getattr(obj, name)
        patches.append((obj, name, original))
        setattr(obj, name, wrapper(original))

    def stage_sync(fn):
        def wrapped(*a, **k):
            count.c["stage_syncs"] += 1
            return fn(*a, **k)
        return wrapped

    def one_launch(replay):  # a graph replay: one launch, the stand-in's operators not counted
        def wrapped(self, g):
            count.c["launches"] += 1
            count.c["graph_replays"] += 1
            count.paused += 1
            try:
                replay(self, g)
            finally:
                count.paused -= 1
        return wrapped

    def forward_count(fn):
        def wrapped(*a, **k):
            count.c["forwards"] += 1
            return fn(*a, **k)
        return wrapped

    patch(StageCalls, "_wait", stage_sync)
    patch(role_model.RoleModel, "count_forward", forward_count)
    patch(torch.cuda, "synchronize", stage_sync)
    patch(torch.cuda.Stream, "synchronize", stage_sync)
    patch(torch.cuda.Event, "synchronize", stage_sync)
    patch(graphs_mod.DiTGraphs, "_replay", one_launch)
    return patches


def host_tables(pipe) -> list:
    """The tensors the components keep on the host by design (tagged host-made for `host_syncs`)."""
    c = pipe.components
    tables = [getattr(dit, "_angles", None) for dit in (c.drafter, c.target) if dit is not None]
    return [t for t in tables if isinstance(t, torch.Tensor)]


def run(pipe, kw, device) -> tuple[dict, float]:
    count = Count()
    for t in host_tables(pipe):
        count.host.add(t)
    patches = counting(count)
    try:
        t0 = time.perf_counter()
        with _Calls(count), _Ops(count):
            pipe(PROMPT, seed=SEED, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    finally:
        for obj, name, original in reversed(patches):
            setattr(obj, name, original)
    counts = dict(count.c)
    counts["sites"] = [{"kind": kind, "site": site, "count": n} for (kind, site), n in count.sites.most_common()]
    return counts, wall


def timed(pipe, kw, device, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        pipe(PROMPT, seed=SEED, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - t0)
    return sorted(walls)[len(walls) // 2]


def main(argv=None, pipe=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-blocks", type=int, default=3)
    ap.add_argument("--modes", default="draft,sdvg", help="draft (the drafter lane alone) and/or sdvg (pattern 0110...)")
    ap.add_argument("--scheduler", default="cpp")
    ap.add_argument("--repeats", type=int, default=3, help="timed videos per variant (median), besides the counted one "
                                                           "(0: none, counts only)")
    ap.add_argument("--variants", default="eager,cuda_graphs",
                    help="comma-separated, in order: " + ", ".join(VARIANTS) + " (each after the first adds its "
                         "change to the one before it)")
    ap.add_argument("--out", default="results/host-syncs")
    ap.add_argument("--rewrite", metavar="DIR", help="only write DIR/results.md again from DIR/results.json")
    args = ap.parse_args(argv)
    if args.rewrite:
        return rewrite(Path(args.rewrite))
    device = torch.device(args.device)
    preset = get_preset(args.preset)
    # gpu_check.py passes its own; random_init "device": counts do not depend on which random model (no host draw)
    pipe = pipe or SpeculativeVideoPipeline(build_random(preset, drafter_device=device, random_init="device"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"preset": preset.name, "num_blocks": args.num_blocks, "scheduler": args.scheduler,
           "provenance": provenance(seed=SEED, prompt=PROMPT, device=device), "runs": []}
    nb = args.num_blocks
    for mode in args.modes.split(","):
        kw = dict(mode=mode, num_blocks=nb, scheduler=args.scheduler)
        if mode == "sdvg":
            kw.update(router="pattern", pattern="0110")
        for name in args.variants.split(","):
            label, changes = VARIANTS[name]
            variant = dict(kw, **changes)
            pipe(PROMPT, seed=SEED, **variant)  # warm-up (captures the graphs, compiles the VAE step)
            counts, _ = run(pipe, variant, device)
            sites = counts.pop("sites")
            wall = timed(pipe, variant, device, args.repeats) if args.repeats else float("nan")
            forwards = counts.get("forwards", 0)
            row = {"mode": mode, "variant": label,
                   "per_block": {k: round(v / nb, 2) for k, v in sorted(counts.items())},
                   "host_syncs_per_forward": round(counts.get("host_syncs", 0) / forwards, 3) if forwards else None,
                   "sites": [dict(x, per_block=round(x["count"] / nb, 2), reason=reason(x["site"])) for x in sites],
                   "wall_s_per_block": wall / nb}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(res, indent=2))
            write_md(res, out)
    return res


def reason(site: str) -> str:
    for frame in site.split(" <- "):
        for keys, why in REASONS.items():
            if all(k in frame for k in keys):
                return why
    return "(no reason recorded: look at the call site)"


def rewrite(folder: Path) -> None:
    """results.md of `folder` again from its results.json, with today's reasons."""
    res = json.loads((folder / "results.json").read_text())
    for r in res["runs"]:
        for x in r.get("sites", []):
            x["reason"] = reason(x["site"])
    (folder / "results.json").write_text(json.dumps(res, indent=2))
    write_md(res, folder)


def write_md(res, out: Path):
    keys = ["launches", "graph_replays", "scalar_reads", "host_syncs", "async_copies", "stage_syncs",
            "blocking_moves"]
    lines = [f"# Host syncs and kernel launches per block ({res['preset']}, {res['num_blocks']} blocks, "
             f"scheduler {res['scheduler']}, {res['provenance']['device_name']})", "",
             "| mode | variant | " + " | ".join(keys) + " | host syncs / forward | wall s / block |",
             "|---" * (len(keys) + 4) + "|"]
    for r in res["runs"]:
        pb = r["per_block"]
        lines.append(f"| {r['mode']} | {r['variant']} | " + " | ".join(str(pb.get(k, 0)) for k in keys)
                     + f" | {r.get('host_syncs_per_forward')} | {r['wall_s_per_block']:.4f} |")
    for r in res["runs"]:
        lines += ["", f"## Host syncs that remain: {r['mode']}, {r['variant']}", ""]
        if not r.get("sites"):
            lines.append("none")
            continue
        lines += ["| per block | kind | call site | reason |", "|---|---|---|---|"]
        lines += [f"| {x['per_block']} | {x['kind']} | `{x['site']}` | {x['reason']} |" for x in r["sites"]]
    lines += ["", provenance_line(res["provenance"]), "", "Counts from one video after a warm-up video; see benchmarks/host_syncs.py for what each column counts. On the CPU the wall "
              "times say nothing about speed (the stand-in replays the whole forward; a shared machine): the GPU "
              "check measures the time."]
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
