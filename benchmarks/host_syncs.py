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
                  per-stage waits (`prepare.sync`, the native driver's `_Stages._wait`), counted even on
                  the CPU where they return at once (`stage_timing="events"` makes none; its one wait per
                  recorded event pair at the end of the video is an `Event.synchronize`, on CUDA only);
  blocking_moves  `.to(device)` / `.cuda()` to another device without `non_blocking`: a host sync (the
                  CPU-drawn noise, the RoPE tables of each eager forward, latents read back); always 0
                  on the CPU, where nothing crosses a device.
Writes results.json (with provenance) and results.md after each variant.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance, provenance_line  # noqa: E402
from sdvg.config import get_preset  # noqa: E402
from sdvg.generation import graphs as graphs_mod, native, prepare  # noqa: E402
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


class Count:
    def __init__(self):
        self.c = Counter()
        self.paused = 0


class _Ops(TorchDispatchMode):
    def __init__(self, count: Count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.count.paused:
            if name == "_local_scalar_dense":
                self.count.c["scalar_reads"] += 1
            elif not func.is_view and name not in _NO_KERNEL:
                self.count.c["launches"] += 1
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    def __init__(self, count: Count):
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.count.paused:
            if name in _READS:
                self.count.c["scalar_reads"] += 1
            elif name in ("to", "cuda") and not kwargs.get("non_blocking") and _crosses(args, kwargs, name):
                self.count.c["blocking_moves"] += 1
        return func(*args, **kwargs)


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

    patch(prepare, "sync", stage_sync)
    patch(native._Stages, "_wait", stage_sync)
    patch(torch.cuda, "synchronize", stage_sync)
    patch(torch.cuda.Stream, "synchronize", stage_sync)
    patch(torch.cuda.Event, "synchronize", stage_sync)
    patch(graphs_mod.DiTGraphs, "_replay", one_launch)
    # the reference loop imported `sync` by name
    from sdvg.generation import reference
    patch(reference, "sync", stage_sync)
    return patches


def run(pipe, kw, device) -> tuple[dict, float]:
    count = Count()
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
    return dict(count.c), wall


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
    ap.add_argument("--repeats", type=int, default=3, help="timed videos per variant (median), besides the counted one")
    ap.add_argument("--variants", default="eager,cuda_graphs",
                    help="comma-separated, in order: " + ", ".join(VARIANTS) + " (each after the first adds its "
                         "change to the one before it)")
    ap.add_argument("--out", default="results/host-syncs")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    preset = get_preset(args.preset)
    pipe = pipe or SpeculativeVideoPipeline(build_random(preset, drafter_device=device))  # gpu_check.py passes its own
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
            wall = timed(pipe, variant, device, args.repeats)
            row = {"mode": mode, "variant": label,
                   "per_block": {k: round(v / nb, 2) for k, v in sorted(counts.items())},
                   "wall_s_per_block": wall / nb}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(res, indent=2))
            write_md(res, out)
    return res


def write_md(res, out: Path):
    keys = ["launches", "graph_replays", "scalar_reads", "stage_syncs", "blocking_moves"]
    lines = [f"# Host syncs and kernel launches per block ({res['preset']}, {res['num_blocks']} blocks, "
             f"scheduler {res['scheduler']}, {res['provenance']['device_name']})", "",
             "| mode | variant | " + " | ".join(keys) + " | wall s / block |", "|---" * (len(keys) + 3) + "|"]
    for r in res["runs"]:
        pb = r["per_block"]
        lines.append(f"| {r['mode']} | {r['variant']} | " + " | ".join(str(pb.get(k, 0)) for k in keys)
                     + f" | {r['wall_s_per_block']:.4f} |")
    lines += ["", provenance_line(res["provenance"]), "", "Counts from one video after a warm-up video; see benchmarks/host_syncs.py for what each column counts. On the CPU the wall "
              "times say nothing about speed (the stand-in replays the whole forward; a shared machine): the GPU "
              "check measures the time."]
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
