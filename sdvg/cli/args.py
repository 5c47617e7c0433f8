"""Argument helpers shared by the commands: checked argparse types, the model and placement flags, the
--config / --protocol pair, and progress lines on stderr."""
from __future__ import annotations

import argparse
import math
import re
import sys

from sdvg.config import MAX_BUDGET_GIB, PRESETS, unknown_preset
from sdvg.io.exit_status import device_type
from sdvg.options import OPTION_NAMES, PROTOCOLS, add_option_flags, flag_of, option_type


_API_NAMES = re.compile(r"\b(" + "|".join(sorted((*OPTION_NAMES, "start_frame"), key=len, reverse=True)) +
                        r")\b(?:=('[^']*'|[\w.-]+))?")


def in_flags(message: str) -> str:
    """An API refusal in the command line's words: `name=False` -> --no-name, `name='v'` -> --name v, and an
    option's (or start_frame's) bare name -> its flag. For messages written in option names (e.g.
    `start_frame_conflict`'s), not free text, where a word such as `mode` would be taken for the option."""
    def flag(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if value is None or value == "True":
            return flag_of(name)
        return "--no-" + flag_of(name)[2:] if value == "False" else f"{flag_of(name)} {value.strip(chr(39))}"

    return _API_NAMES.sub(flag, message)


def engines_folder(text: str) -> str:
    """`--engines DIR`: a folder `python -m build_engines --out DIR` wrote (refused at parse time, before any
    model loads, when the path names something that is not a folder)."""
    from pathlib import Path

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is a file, not an engine folder; give the folder that "
                                         "`python -m build_engines --out DIR` wrote (it holds one subfolder per engine)")
    return text


def count(low: int, high: int | None = None):
    """argparse type: an integer >= low (and <= high)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"{v} must lie in [{low}, {high}]")
        return v

    return parse


def real(low: float = -math.inf, high: float = math.inf):
    """argparse type: a finite number in [low, high] (NaN and infinities refused)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
        if not math.isfinite(v) or not low <= v <= high:
            bounds = "a finite number" if (low, high) == (-math.inf, math.inf) else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text[:40]} must be {bounds}")
        return v

    return parse


def taus(text: str) -> list[float]:
    """--taus: a comma list of numbers (inf / -inf allowed), or `paper` (the paper's seven values)."""
    from sdvg.evaluation.sweep import PAPER_TAUS

    if text.strip().lower() == "paper":
        return list(PAPER_TAUS)
    parse = option_type("tau")
    values = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"--taus {text!r} holds no value; e.g. --taus=-1.5,-0.7 or --taus paper")
    return list(dict.fromkeys(values))


def seeds(text: str) -> list[int]:
    """--seeds: a comma list of seeds (integers >= 0)."""
    parse = option_type("seed")
    values = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"--seeds {text!r} holds no seed; e.g. --seeds 0,1")
    return list(dict.fromkeys(values))


def add_generation_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Model and placement flags, the memory budget, then one flag per generation option (minus `exclude`)."""
    add_model_args(p)
    p.add_argument("--memory-budget-gib", type=real(0, MAX_BUDGET_GIB), default=None,
                   help="memory each device may hold for this pipeline in GiB (weights, KV caches, prompt K/V, as "
                        "`sdvg memory --budget-gib` counts), checked before each video allocates its KV caches; "
                        "default: each device's free memory (CUDA: free + PyTorch's cache; CPU: MemAvailable)")
    add_option_flags(p, exclude=exclude)


def add_model_args(p: argparse.ArgumentParser, engines: bool = True, loading: bool = True) -> None:
    """The preset, checkpoint and device flags (`python -m build_engines` takes the same ones, so an
    engine folder is built from the weights `generate` loads); `loading`: also how the pipeline is held
    (--dtype, --offload-text-encoder), for the commands that build one."""
    random = sorted(k for k, v in PRESETS.items() if v.random_weights)
    real_weights = sorted(k for k, v in PRESETS.items() if not v.random_weights)
    p.add_argument("--preset", default="tiny", type=preset_name,
                   help=f"random weights: {', '.join(random)}; real weights (from the HF cache, or the flags below): "
                        f"{', '.join(real_weights)}")
    where = " (a local path or a hub repo org/name[@revision][/file]; default: the preset's)"
    p.add_argument("--drafter", help="drafter checkpoint: Self-Forcing .pt, .safetensors or diffusers folder" + where)
    p.add_argument("--target", help="target checkpoint: Krea .safetensors, original Wan or diffusers folder" + where)
    p.add_argument("--vae", help="Wan2.1 VAE: .pth or diffusers folder" + where)
    p.add_argument("--reward", help="ImageReward.pt" + where)
    p.add_argument("--reward-tokenizer", help="bert-base-uncased tokenizer folder" + where)
    p.add_argument("--text-encoder", help="umT5 encoder folder or a diffusers Wan folder" + where)
    if engines:
        p.add_argument("--engines", type=engines_folder,
                       help="engine folder built by `python -m build_engines` from the same preset and "
                                         "checkpoint flags (backend tensorrt; onnxruntime with --format onnx; "
                                         "torch-tensorrt with --format torch-tensorrt)")
        from sdvg.options import TRT_RUNTIMES

        p.add_argument("--trt-runtime", choices=TRT_RUNTIMES, default=TRT_RUNTIMES[0],
                       help="how TensorRT plans run: torch (torch's current stream) or cuda-python (stream-ordered "
                            "engine memory on the executor's own stream; the tensorrt extra)")
        p.add_argument("--trt-cuda-graphs", action="store_true",
                       help="capture the static-shape DiT engines in CUDA graphs (--trt-runtime cuda-python)")
    p.add_argument("--device", "--drafter-device", dest="device", default="cpu", type=device_type,
                   help="drafter, VAE and reward device")
    p.add_argument("--target-device", default=None, type=device_type, help="target device (default: --device)")
    if not loading:
        return
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the models' precision instead of the preset's (the API's torch_dtype)")
    p.add_argument("--offload-text-encoder", action="store_true",
                   help="keep umT5 on the CPU; it visits --device only to encode a prompt it has not cached "
                        "(TextEncoder.enable_offload)")
    from sdvg.options import COMPILE_MODES

    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=COMPILE_MODES[0],
                   help="--backend compile: torch.compile's mode for the DiT blocks' regions, the VAE decode and the "
                        "reward model (max-autotune-no-cudagraphs tunes each GEMM: a longer first video)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="--backend compile: inductor's persistent cache folder (TORCHINDUCTOR_CACHE_DIR; made if "
                        "missing, must be writable): a later process reuses the compiled kernels; default: torch's")


DTYPES = ("float32", "bfloat16", "float16")


def _config_text(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not a path or hub repo; give a string")
    return value


def _config_preset(value) -> str:
    check_preset(_config_text(value))
    return value


def _config_flag(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} must be true or false")
    return value


def _config_choice(choices):
    def check(value):
        if value not in choices:
            raise ValueError(f"{value!r}; choose one of {', '.join(choices)}")
        return value
    return check


# The keys a --config file may hold besides the generation options: the model and placement flags, by
# their argparse names, each checked as its flag is (a file written by `sdvg calibrate` holds them too).
MODEL_CONFIG_KEYS = {
    "preset": _config_preset, **{k: _config_text for k in ("drafter", "target", "vae", "reward", "reward_tokenizer",
                                                          "text_encoder")},
    "device": lambda v: device_type(_config_text(v)), "target_device": lambda v: device_type(_config_text(v)),
    "engines": lambda v: engines_folder(_config_text(v)), "dtype": _config_choice(DTYPES),
    "offload_text_encoder": _config_flag,
}


def add_config(p: argparse.ArgumentParser, config: dict | None) -> None:
    """--config FILE and --protocol NAME; `config` (their values, read before the full parse) becomes the
    parser's defaults, so flags given on the command line still win."""
    p.add_argument("--config", help="YAML or JSON file of generation options (keys: the option names) and model "
                                    "flags (preset, drafter, target, vae, reward, reward_tokenizer, text_encoder, "
                                    "device, target_device, engines, dtype, offload_text_encoder); flags given "
                                    "here override it")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS),
                   help="a named protocol: paper = the SDVG paper's loop (drafter on its own drafts, block 0 from "
                        "the target, worst-frame score, 9 blocks, seed 42); a --config file and flags override it")
    if config:
        p.set_defaults(**config)


def config_values(argv: list[str]) -> dict:
    """The option defaults of `--protocol NAME`, then of `--config FILE` on top (read before the full
    parse; errors exit 2 naming the file)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--protocol")
    known, _ = pre.parse_known_args(argv)
    values = dict(PROTOCOLS.get(known.protocol, {}))  # an unknown name is refused by the full parse
    if not known.config:
        return values
    from sdvg.options import OptionError, load_options_file

    try:
        return {**values, **load_options_file(known.config, extra=MODEL_CONFIG_KEYS)}
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_preset(name: str) -> None:
    """An unknown preset is bad input (exit 2), refused before any model loads."""
    if name not in PRESETS:
        raise ValueError(unknown_preset(name))


def preset_name(text: str) -> str:
    """argparse type of --preset: a preset's name, refused at parse time (exit 2, nothing imported or
    loaded), the closest names offered."""
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(unknown_preset(text))
    return text


def say(args, message: str) -> None:
    """A progress line on stderr, unless --quiet."""
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def bar(args, total: int, desc: str, unit: str, initial: int = 0):
    """A tqdm progress bar on stderr, off under --quiet and where stderr is no terminal (sdvg.io.progress)."""
    from sdvg.io.progress import progress_bar

    return progress_bar(total, show=not args.quiet, initial=initial, desc=desc, unit=unit)
