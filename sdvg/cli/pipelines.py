"""Pipeline building from the flags (the default loader of the commands that load one; `main` takes
another, such as a test's ready pipeline), the device placement under torchrun, and the lines that say
what --protocol set."""
from __future__ import annotations

import sys
from typing import Any, Callable

from sdvg.config import PRESETS
from sdvg.options import BACKENDS

from sdvg.cli.args import check_preset, say

# (parsed arguments) -> a SpeculativeVideoPipeline
Loader = Callable[[Any], Any]


def build_pipeline(args):
    """The pipeline the flags name, with a line before and after loading (unless --quiet)."""
    import time

    t0 = time.perf_counter()
    what = f"preset {args.preset!r}" + ("" if args.preset not in PRESETS or not PRESETS[args.preset].random_weights
                                        else " (random weights)")
    say(args, f"loading {what} ...")
    pipe = pipeline_from_flags(args)
    if getattr(args, "trt_runtime", None) is not None:
        pipe.set_engine_executor(args.trt_runtime, args.trt_cuda_graphs)
    say(args, f"loaded in {time.perf_counter() - t0:.1f} s")
    return pipe


def pipeline_from_flags(args):
    """Random weights for a random-weight preset without checkpoint flags; real weights otherwise (the
    preset's published files, each replaced by its flag when given). --quantization quantizes the DiTs it
    names in place as they load (their model-dtype linear weights dropped)."""
    import torch

    from sdvg.config import get_preset
    from sdvg.pipeline import SpeculativeVideoPipeline

    check_preset(args.preset)
    preset = get_preset(args.preset)
    paths = dict(drafter=args.drafter, target=args.target, vae=args.vae, text_encoder=args.text_encoder,
                 reward=args.reward, reward_tokenizer=args.reward_tokenizer)
    backend = args.backend or BACKENDS[0]
    budget = getattr(args, "memory_budget_gib", None)
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    quantization = getattr(args, "quantization", None)
    compiling = dict(compile_mode=getattr(args, "compile_mode", "default"), compile_cache=getattr(args, "compile_cache",
                                                                                                  None))
    if preset.random_weights and not any(paths.values()):
        pipe = SpeculativeVideoPipeline.from_preset(preset, device=args.device, target_device=args.target_device,
                                                    backend=backend, engines=args.engines, torch_dtype=dtype,
                                                    memory_budget_gib=budget, quantization=quantization, **compiling)
    else:
        pipe = SpeculativeVideoPipeline.from_pretrained(preset, **paths, drafter_device=args.device,
                                                        target_device=args.target_device, backend=backend,
                                                        engines=args.engines, torch_dtype=dtype,
                                                        memory_budget_gib=budget,
                                                        progress=not getattr(args, "quiet", False),
                                                        quantization=quantization, **compiling)
    if getattr(args, "offload_text_encoder", False):
        pipe.text_encoder.enable_offload(args.device)
    return pipe


def place_for_torchrun(args) -> tuple[int, int]:
    """Under torchrun each process takes its own GPU pair (or GPU), unless devices are given; returns
    (rank, world)."""
    import torch

    from sdvg.evaluation.sweep import dist_env

    rank, world, local = dist_env()
    if world > 1 and args.device == "cpu" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n >= 2 * world:
            args.device, args.target_device = f"cuda:{2 * local}", f"cuda:{2 * local + 1}"
        else:
            args.device = f"cuda:{local % n}"
    return rank, world


def announce_protocol(args, preset, opts) -> None:
    """Say what --protocol set (and the resolution it keeps)."""
    if getattr(args, "protocol", None) and not getattr(args, "quiet", False):
        from sdvg.options import describe_protocol

        for line in describe_protocol(args.protocol, opts, preset.video.height, preset.video.width,
                                      preset.random_weights):
            print(line, file=sys.stderr)
