"""python -m build_engines --preset tiny --format onnx --verify --out engines/"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path


from build_engines.export import VERIFY_TOLERANCE, export_onnx, verify_onnx
from build_engines.trt import build_engine
from sdvg.engines.cache import EngineCache
from sdvg.engines.signatures import STAGE_NAMES, all_stages, stage_key
from sdvg.engines.tensorrt import import_tensorrt


def rebuild_command(argv: list[str]) -> str:
    return "python -m build_engines " + " ".join(shlex.quote(a) for a in argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m build_engines", description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--drafter-device", default="cpu")
    ap.add_argument("--target-device", default=None)
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                    help="default: the preset's precision")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV capacity in blocks (default: the preset's)")
    ap.add_argument("--format", choices=("onnx", "tensorrt"), default="tensorrt")
    ap.add_argument("--verify", action="store_true", help="run every exported stage in onnxruntime against eager")
    ap.add_argument("--timing-cache", type=Path, default=None)
    ap.add_argument("--stages", default="all", help="comma list of drafter_dit,target_dit,vae_decode,reward")
    ap.add_argument("--out", type=Path, default=Path("engines"))
    args = ap.parse_args(argv)
    wanted = set(STAGE_NAMES) if args.stages == "all" else {w.strip() for w in args.stages.split(",") if w.strip()}
    unknown = sorted(wanted - set(STAGE_NAMES))
    if unknown or not wanted:  # checked before anything is built
        print(f"error: unknown stage(s) {', '.join(unknown) or '(none given)'} in --stages; the stages are "
              f"{', '.join(STAGE_NAMES)} (or all)", file=sys.stderr)
        return 2

    from sdvg.config import get_preset
    from sdvg.models.components import build_random

    if args.format == "tensorrt":
        import_tensorrt()  # fail before any heavy work, with the install hint
    preset = get_preset(args.preset)
    if args.precision:
        preset = preset.replace(precision=args.precision)
    comps = build_random(preset, drafter_device=args.drafter_device, target_device=args.target_device)
    stages = all_stages(comps, args.num_blocks)
    if args.stages != "all":
        stages = [s for s in stages if s.name in wanted]
    cache = EngineCache(args.out)
    tol = VERIFY_TOLERANCE[preset.precision]
    failed = []
    for st in stages:
        t0 = time.perf_counter()
        onnx_path = args.out / "onnx" / f"{st.name}.onnx"
        export_onnx(st, onnx_path)
        msg = f"{st.name}: exported in {time.perf_counter() - t0:.1f} s"
        if args.verify:
            err = verify_onnx(st, onnx_path)
            ok = err <= tol
            msg += f"; onnxruntime vs eager max error {err:.2e} ({'ok' if ok else 'FAIL'}, tolerance {tol:.0e})"
            if not ok:
                failed.append(st.name)
        if args.format == "tensorrt":
            plan = build_engine(onnx_path, onnx_path.with_suffix(".plan"), args.timing_cache)
            dest = cache.store(stage_key(st, preset.precision, "tensorrt"), plan, rebuild_command(argv))
            msg += f"; engine {dest}"
        else:
            dest = cache.store(stage_key(st, preset.precision, "onnx"), onnx_path, rebuild_command(argv))
            msg += f"; {dest}"
        print(msg)
    if failed:
        print(f"verification failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cli() -> int:
    try:
        return main()
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
