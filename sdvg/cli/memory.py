"""`sdvg memory`: the resident memory of a pipeline per device (weights, FP8 weights with --quantization,
KV caches per context mode, prompt K/V, VAE, ImageReward, umT5), computed before anything is allocated,
and a per-device budget check (exit 2 when a device does not fit)."""
from __future__ import annotations

import json
from pathlib import Path

from sdvg.config import MAX_BUDGET_GIB, KVWindow, RoleContext
from sdvg.options import add_option_flags, options_from_args

from sdvg.cli.args import check_preset, in_flags, real

MEMORY_OPTIONS = ("mode", "num_blocks", "target_context", "drafter_cache", "kv_cache_frames", "keep_first_frame",
                  "window_frames", "sink_frames", "quantization")


def add_parser(sub, config: dict | None = None) -> None:
    m = sub.add_parser("memory", help="resident memory per device (weights, KV caches per context mode, prompt K/V, "
                                      "VAE, ImageReward, umT5), computed before allocating")
    m.add_argument("--preset", default="wan2.1")
    m.add_argument("--device", "--drafter-device", dest="device", default="cuda:0",
                   help="drafter, VAE and reward device (a label here)")
    m.add_argument("--target-device", default="cuda:1", help="target device (a label; the same as --device for one "
                                                             "device)")
    m.add_argument("--text-encoder-device", help="where umT5 stays (default: --device; cpu = offloaded)")
    m.add_argument("--budget-gib", type=real(0, MAX_BUDGET_GIB),
                   help="memory of each device in GiB (a 48 GB card: 44.7)")
    m.add_argument("--backend", choices=("eager", "tensorrt"), default="eager",
                   help="tensorrt: the DiTs as engines (each engine's own copy of the weights, the torch DiT's kept "
                        "parts, one scratch buffer per role) instead of the torch weights")
    m.add_argument("--engines", type=Path, default=None,
                   help="with --backend tensorrt: a built engine folder (plan sizes; scratch from TensorRT when it is "
                        "installed)")
    m.add_argument("--start-frame", nargs="?", const=True, default=None, metavar="IMAGE",
                   help="count a start frame (sdvg generate --start-frame IMAGE): its --kv-cache-frames latent frames "
                        "sit in every full context before block 0 (the image itself is not read: its size is the "
                        "preset's)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    add_option_flags(m, only=MEMORY_OPTIONS)
    m.set_defaults(func=run)


def run(args, load_pipeline=None) -> int:
    """The plan as text or JSON; 2 when a device exceeds --budget-gib. Loads nothing."""
    import sys

    from sdvg.config import get_preset
    from sdvg.models.memory import GIB, device_totals, format_plan, kv_bytes, plan_memory

    check_preset(args.preset)
    preset = get_preset(args.preset)
    opts = options_from_args(args).resolved(preset)
    from sdvg.options import backend_conflicts

    conflicts = backend_conflicts(opts, args.backend)
    if conflicts:
        print(f"error: {conflicts[0]}", file=sys.stderr)
        return 2
    fp8_roles = tuple(r for r in opts.fp8_roles() if r in opts.roles)  # quantized in place, as the CLI loads them
    roles = opts.roles
    contexts = {role: opts.role_context(role) for role in roles}
    te_device = args.text_encoder_device or args.device
    prefix = 0
    if args.start_frame is not None:
        from sdvg.generation.prepare import start_frame_conflict

        why = start_frame_conflict(opts.replace(backend=args.backend))
        if why:
            print(f"error: {in_flags(why)}", file=sys.stderr)
            return 2
        prefix = opts.kv_cache_frames
    items = plan_memory(preset, contexts, opts.num_blocks, args.device, args.target_device, te_device, prefix,
                        fp8_roles)
    if getattr(args, "backend", "eager") == "tensorrt":  # engines in place of the torch DiTs (docs/engines.md)
        from sdvg.engines.resident import engine_items
        from sdvg.engines.signatures import preset_signatures

        sigs = preset_signatures(preset, opts.num_blocks, opts.kv_cache_frames)
        items = [it for it in items if it.what not in (f"{r} weights" for r in roles)] + engine_items(
            preset, roles, sigs, args.device, args.target_device, args.engines)
    modes = {}
    for role in roles:
        chosen = contexts[role]
        modes[role] = {}
        for mode in ("full", "recompute"):
            ctx = RoleContext(mode, chosen.kv_cache_frames, chosen.keep_first_frame,
                              chosen.window if mode == "full" else KVWindow())
            modes[role][mode] = kv_bytes(preset, role, ctx, opts.num_blocks, prefix_frames=prefix)
    totals = device_totals(items)
    if args.json:
        print(json.dumps({"preset": preset.name, "precision": preset.precision, "num_blocks": opts.num_blocks,
                          "start_frame_latent_frames": prefix, "quantization": opts.quantization,
                          "backend": getattr(args, "backend", "eager"),
                          "contexts": {r: c.mode for r, c in contexts.items()},
                          "kv_cache_gib_per_mode": {r: {m: v[0] / GIB for m, v in d.items()} for r, d in modes.items()},
                          "items": [{"device": it.device, "what": it.what, "gib": it.gib, "arithmetic": it.arithmetic}
                                    for it in items],
                          "device_total_gib": {d: t / GIB for d, t in totals.items()},
                          "budget_gib": args.budget_gib}, indent=2))
    else:
        frames = opts.num_blocks * preset.video.frames_per_block
        print(f"sdvg memory: preset {preset.name}, {preset.precision}, {opts.num_blocks} blocks ({frames} latent "
              f"frames{f', after a start frame of {prefix}' if prefix else ''}), backend "
              f"{getattr(args, 'backend', 'eager')}{f', quantization {opts.quantization}' if fp8_roles else ''}; "
              "nothing allocated")
        print("KV cache per context mode (* = this run's):")
        for role, d in modes.items():
            for mode, (nbytes, how) in d.items():
                mark = "*" if contexts[role].mode == mode else " "
                print(f" {mark} {role:<8} {nbytes / GIB:8.2f} GiB   ({how})")
        for line in format_plan(items, args.budget_gib):
            print(line)
        print("(a 48 GB card holds 44.7 GiB; an 80 GB card 74.5 GiB; activations and CUDA context come on top)")
    if args.budget_gib is not None:
        over = {d: t / GIB for d, t in totals.items() if t / GIB > args.budget_gib}
        for device, gib in over.items():
            who = ", ".join(sorted({it.what.split()[0] for it in items if it.device == device}))
            print(f"error: device {device} ({who}) needs {gib:.2f} GiB > budget {args.budget_gib:g} GiB; use the "
                  "recompute target context, a local window, fewer blocks, --text-encoder-device cpu or a larger "
                  "device", file=sys.stderr)
        if over:
            return 2
    return 0
