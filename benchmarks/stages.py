"""Per-engine latency, eager vs torch.compile (and TensorRT engines if given), on one preset.

    python benchmarks/stages.py --preset real-size --device cuda:0 --out results/stages-h200

Times one DiT forward of a block with a KV cache holding `--context-blocks` committed blocks (drafter
and target), one steady-state VAE decode of a latent frame, and one reward forward of a later
block's frames. CUDA events on a GPU (perf_counter on the CPU), warm-up excluded, median of
--repeats. Each compiled engine module is also compared with eager (max abs difference). The example
inputs are made on the engine's device (`EngineSignature.example_inputs`); `main(argv, comps=...)`
measures components built by the caller (benchmarks/gpu_check.py).

The file's name, its `--out` default and the results' `"stages"` key (engine name -> times) predate
the word "engine" for these modules and are kept: commands and results files already use them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdvg.engines.signatures import dit_engine_spec, reward_engine_spec, vae_engine_spec  # noqa: E402
from sdvg.config import get_preset  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from provenance import provenance  # noqa: E402
from timing import median_seconds  # noqa: E402


def main(argv=None, comps=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context-blocks", type=int, default=4)
    ap.add_argument("--backends", default="eager,compile")
    ap.add_argument("--out", default="results/stages")
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    if comps is None:
        comps = build_random(preset, drafter_device=args.device, random_init="device")  # timing only: no host draw
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a realistic visibility: `context_blocks` committed blocks
    visible = args.context_blocks * preset.video.frames_per_block
    specs = [dit_engine_spec(comps, "drafter", visible), dit_engine_spec(comps, "target", visible),
             vae_engine_spec(comps), reward_engine_spec(comps)]
    res = {"preset": preset.name, "device": args.device,
           "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "provenance": provenance(device=args.device), "stages": {}}
    # eager first for every engine, then compile engine by engine: compiling a real-size DiT takes
    # minutes, and a time limit then still leaves every eager number on disk
    eager_out = {}
    for s in specs:
        with torch.no_grad():
            eager_out[s.name] = s.module(*s.inputs)
            res["stages"][s.name] = {"eager_s": median_seconds(lambda: s.module(*s.inputs), s.device, args.repeats)}
        print(s.name, json.dumps(res["stages"][s.name]), flush=True)
        (out / "stages.json").write_text(json.dumps(res, indent=2))
    if "compile" in args.backends:
        for s in specs:
            row = res["stages"][s.name]
            with torch.no_grad():
                t0 = time.perf_counter()
                compiled = torch.compile(s.module, dynamic=False)
                comp_out = compiled(*s.inputs)
                row["compile_time_s"] = time.perf_counter() - t0
                row["compile_s"] = median_seconds(lambda: compiled(*s.inputs), s.device, args.repeats)
            row["compile_speedup"] = row["eager_s"] / row["compile_s"]
            a = eager_out[s.name] if isinstance(eager_out[s.name], (tuple, list)) else [eager_out[s.name]]
            b = comp_out if isinstance(comp_out, (tuple, list)) else [comp_out]
            row["compile_max_abs_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
            print(s.name, json.dumps(row), flush=True)
            (out / "stages.json").write_text(json.dumps(res, indent=2))  # after each engine
    return res


if __name__ == "__main__":
    main()
