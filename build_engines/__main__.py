"""python -m build_engines --preset tiny --format onnx --verify --out engines/

Loads the pipeline exactly as `sdvg generate` does (the same preset, checkpoint and device flags),
derives every engine signature on the meta device (`sdvg.engines.signatures`), exports each engine
module to ONNX and, for --format tensorrt, builds it into a TensorRT plan; for --format torch-tensorrt
the DiT engines go through torch.export and torch-tensorrt instead (the others as for tensorrt). Every
artifact goes into the engine cache under a key of its config, weights, shapes, precision, device
and library versions. `--stages` selects engine families (the flag keeps its name).

One engine at a time (`build_engines/plan.py`): export, free the example inputs, move a DiT engine's
torch DiT to the host, build, delete the ONNX file and its `.data` (right after TensorRT has parsed
them), move the DiT back. `--dry-run` prints that plan's disk, GPU and host-memory peaks per engine
from the configs alone (meta device, no TensorRT) against `--gpu-gib` / `--disk-gib` /
`--host-gib` (one H200 machine: 139 / 64 / 128); a real build checks the same plan against those
limits and this machine's free disk and GPU memory before it loads anything."""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from pathlib import Path


def rebuild_command(argv: list[str]) -> str:
    return "python -m build_engines " + " ".join(shlex.quote(a) for a in argv)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _gib(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a positive number of GiB")
    return v


def parser() -> argparse.ArgumentParser:
    from build_engines.plan import H200_LIMITS

    from sdvg.cli import add_model_args
    from sdvg.generation.backends import BUILD_FORMATS

    ap = argparse.ArgumentParser(prog="python -m build_engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, engines=False, loading=False)
    ap.add_argument("--weights-seed", type=int, default=0,
                    help="seed of a random-weight preset's weights (the API's from_preset(seed=...); default 0)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                    help="default: the preset's precision (the API's torch_dtype)")
    ap.add_argument("--num-blocks", type=_positive, default=None,
                    help="longest video the cached DiT engines' profiles cover, in blocks (default: the preset's; "
                         "ONNX files take any length)")
    ap.add_argument("--kv-cache-frames", type=_positive, default=None,
                    help="recompute context length the context-forward engines are built for (default: the preset's)")
    ap.add_argument("--format", choices=BUILD_FORMATS, default="tensorrt",
                    help="onnx (the onnxruntime backend), tensorrt (the tensorrt backend) or torch-tensorrt (the "
                         "torch-tensorrt backend: DiT engines through torch-tensorrt, the others TensorRT plans)")
    ap.add_argument("--verify", action="store_true", help="run every exported engine in onnxruntime against eager")
    ap.add_argument("--timing-cache", type=Path, default=None)
    ap.add_argument("--stages", default="all",
                    help="engine families to build, a comma list of drafter_dit,target_dit,vae_decode,reward (default all)")
    ap.add_argument("--out", type=Path, default=Path("engines"))
    ap.add_argument("--dry-run", action="store_true",
                    help="print the per-engine build plan (disk, GPU and host-memory peaks, from the configs on the "
                         "meta device) against the limits and exit; needs no TensorRT and loads no weights")
    ap.add_argument("--workspace-gib", type=_gib, default=8.0, help="TensorRT builder workspace limit (default 8)")
    for kind, what in (("gpu", "GPU memory"), ("disk", "disk under --out"), ("host", "host memory")):
        ap.add_argument(f"--{kind}-gib", type=_gib, default=H200_LIMITS[kind],
                        help=f"{what} the build may use, in GiB (default {H200_LIMITS[kind]:g}: one H200 machine); a "
                             "plan past it is refused before any work")
    return ap


def plan_for(args, wanted):
    """(build plan, limits from the flags) of this command line, from the configs alone."""
    from build_engines.plan import build_plan, flag_limits
    from sdvg.config import get_preset
    from sdvg.engines.signatures import ENGINE_FAMILIES, preset_signatures

    preset = get_preset(args.preset)
    if args.precision:
        preset = preset.replace(precision=args.precision)
    sigs = preset_signatures(preset, args.num_blocks, args.kv_cache_frames,
                             families=tuple(f for f in ENGINE_FAMILIES if f in wanted))
    fmt = "tensorrt" if args.format == "torch-tensorrt" else args.format
    plan = build_plan(preset, sigs, fmt, args.device, args.target_device, args.workspace_gib)
    return plan, flag_limits(args.gpu_gib, args.disk_gib, args.host_gib)


@contextlib.contextmanager
def off_device(module, device):
    """`module` (a DiT's weights) on the host for the block, back on `device` after: the builder's copy
    of the weights is then the only one on the GPU."""
    device = torch_device(device)
    if device.type != "cuda":
        yield
        return
    import torch

    torch.nn.Module.to(module, "cpu")
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        torch.nn.Module.to(module, device)


def torch_device(device):
    import torch

    return torch.device(device)


def load_pipeline(args):
    """The pipeline `sdvg generate` builds from the same flags: random weights for a random-weight
    preset without checkpoint flags, real weights otherwise (the preset's published files, each
    replaced by its flag when given)."""
    from sdvg.config import get_preset
    from sdvg.pipeline import SpeculativeVideoPipeline

    preset = get_preset(args.preset)
    if args.precision:
        preset = preset.replace(precision=args.precision)
    paths = dict(drafter=args.drafter, target=args.target, vae=args.vae, text_encoder=args.text_encoder,
                 reward=args.reward, reward_tokenizer=args.reward_tokenizer)
    if preset.random_weights and not any(paths.values()):
        return SpeculativeVideoPipeline.from_preset(preset, seed=args.weights_seed, device=args.device,
                                                    target_device=args.target_device)
    if args.weights_seed:
        raise ValueError("--weights-seed sets random weights; it does not go with checkpoint flags")
    return SpeculativeVideoPipeline.from_pretrained(preset, **paths, drafter_device=args.device,
                                                    target_device=args.target_device)


def main(argv=None) -> int:
    from sdvg.engines.signatures import ENGINE_FAMILIES

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    wanted = set(ENGINE_FAMILIES) if args.stages == "all" else {w.strip() for w in args.stages.split(",") if w.strip()}
    unknown = sorted(wanted - set(ENGINE_FAMILIES))
    if unknown or not wanted:  # checked before anything is built
        print(f"error: unknown engine famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown) or '(none given)'} "
              f"in --stages; the engine families are {', '.join(ENGINE_FAMILIES)} (or all)", file=sys.stderr)
        return 2

    from build_engines.plan import check_plan, format_plan, measured_limits

    plan, limits = plan_for(args, wanted)
    fmt = "tensorrt" if args.format == "torch-tensorrt" else args.format
    if args.dry_run:
        print("\n".join(format_plan(plan, limits, fmt)))
        problems = check_plan(plan, limits)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2 if problems else 0
    limits = measured_limits(limits, args.out, {d for d in (args.device, args.target_device) if d})
    problems = check_plan(plan, limits)
    if problems:  # before any weight is loaded or any file written
        print("\n".join(format_plan(plan, limits, fmt)), file=sys.stderr)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2

    from sdvg.io.locks import lock_engine_folder

    with lock_engine_folder(args.out):  # a second build into this folder is refused before anything loads
        from build_engines.export import VERIFY_TOLERANCE, export_onnx, export_opset, verify_onnx
        from sdvg.engines.cache import EngineCache
        from sdvg.engines.signatures import component_signatures, engine_key, engine_spec
        from sdvg.engines.tensorrt import import_tensorrt

        if args.format != "onnx":
            import_tensorrt()  # fail before any heavy work, with the install hint
            if args.format == "torch-tensorrt":
                from sdvg.engines.torch_trt import import_torch_tensorrt

                import_torch_tensorrt()
            cpu = [d for d in (args.device, args.target_device) if d is not None and not str(d).startswith("cuda")]
            if cpu:
                print(f"error: TensorRT engines run on CUDA devices, not {', '.join(cpu)}; pass --device cuda:0 (and "
                      "--target-device), or --format onnx for the onnxruntime backend", file=sys.stderr)
                return 2
        t0 = time.perf_counter()
        comps = load_pipeline(args).components
        print(f"loaded preset {args.preset!r} ({comps.preset.precision}) in {time.perf_counter() - t0:.1f} s", flush=True)
        sigs = component_signatures(comps, args.num_blocks, args.kv_cache_frames,
                                    families=tuple(f for f in ENGINE_FAMILIES if f in wanted))
        missing = sorted(wanted - {s.family for s in sigs})
        if missing and args.stages != "all":
            print(f"error: the pipeline has no {', '.join(missing)} (no model loaded for it)", file=sys.stderr)
            return 2
        cache = EngineCache(args.out)
        tol = VERIFY_TOLERANCE[comps.preset.precision]
        opset, why = export_opset()
        print(f"ONNX opset {opset} ({why})", flush=True)
        failed = []
        for sig in sigs:  # one engine at a time: nothing of an engine outlives its iteration but its cache entry
            t0 = time.perf_counter()
            spec = engine_spec(comps, sig)
            dit = getattr(comps, sig.family[: -len("_dit")]) if sig.family.endswith("_dit") else None
            if args.format == "torch-tensorrt" and dit is not None:
                from sdvg.engines.torch_trt import build_program

                program = build_program(spec.module, sig, spec.inputs, args.out / "torch_trt" / sig.name / "program.ep")
                dest = cache.store(engine_key(sig, comps, "torch-tensorrt"), program, rebuild_command(argv))
                del spec, program
                print(f"{sig.name}: torch-tensorrt program {dest} in {time.perf_counter() - t0:.1f} s", flush=True)
                continue
            onnx_path = export_onnx(spec, args.out / "onnx" / sig.name / "model.onnx", opset)
            msg = f"{sig.name}: exported in {time.perf_counter() - t0:.1f} s"
            if args.verify:
                err = verify_onnx(spec, onnx_path)
                ok = err <= tol
                msg += f"; onnxruntime vs eager max error {err:.2e} ({'ok' if ok else 'FAIL'}, tolerance {tol:.0e})"
                if not ok:
                    failed.append(sig.name)
            if args.format != "onnx":
                from build_engines.trt import build_engine

                key = engine_key(sig, comps, "tensorrt")  # the weights fingerprint while the weights are in place
                device = spec.device
                del spec  # the example inputs (a cached target engine's: GBs) go before the builder runs
                with off_device(dit.model, device) if dit is not None else contextlib.nullcontext():
                    plan_path = build_engine(onnx_path, onnx_path.with_suffix(".plan"), sig, args.timing_cache,
                                             args.workspace_gib, delete_onnx_after_parse=True)
                dest = cache.store(key, plan_path, rebuild_command(argv))
                msg += f"; engine {dest} (ONNX file deleted)"
            else:
                dest = cache.store(engine_key(sig, comps, "onnx"), onnx_path, rebuild_command(argv))
                msg += f"; {dest}"
            print(msg, flush=True)
        if failed:
            print(f"verification failed for: {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0


def cli(argv=None) -> int:
    """`main` with errors as one line on stderr and exit status 2 (bad input: an unknown preset, a
    missing checkpoint, a device that does not exist, TensorRT not installed)."""
    try:
        return main(argv)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
