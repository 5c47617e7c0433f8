"""VAE decode per block and reward scoring per block: the batched scorer (one forward for all frames of
the block) against a per-frame loop (one forward per frame, as the image-reward package's `score()`
runs), on the same model, in one run.

The package itself is not in the runtime environment (it runs only on transformers <= 4.55.4); that
sdvg's scores equal its `score()` is checked by scripts/reward_oracle.sh, in its own environment.

    python benchmarks/vae_reward.py --preset cpu-bench --out results/vae-reward-cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdvg.config import get_preset  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from sdvg.models.vae import to_uint8_frames, to_unit_frames  # noqa: E402
from timing import median_seconds  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/vae-reward")
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    comps = build_random(preset, drafter_device=args.device, need_drafter=False, need_target=False)
    dev = comps.drafter_device
    lh, lw = preset.video.latent_hw(preset.vae)
    g = torch.Generator().manual_seed(0)
    first = torch.randn(1, preset.vae.z_dim, 3, lh, lw, generator=g)
    later = torch.randn(1, preset.vae.z_dim, 3, lh, lw, generator=g)

    cache = comps.vae.new_cache()
    comps.vae.decode(first, cache)
    snap = cache.snapshot()

    def decode_later():
        cache.restore(snap)
        return comps.vae.decode(later, cache)

    t_decode = median_seconds(decode_later, dev, args.repeats)
    pixels = decode_later()
    frames = to_uint8_frames(pixels)  # a later block: 12 frames
    unit = to_unit_frames(pixels)
    sc = comps.scorer
    prompt = "a red fox running through fresh snow"
    t_batched = median_seconds(lambda: sc.score(prompt, unit), dev, args.repeats)
    t_loop = median_seconds(lambda: [sc.score(prompt, frames[i:i + 1]) for i in range(len(frames))], dev,
                            args.repeats)
    res = {"preset": preset.name, "device": str(dev), "frames_per_block": int(frames.shape[0]),
           "resolution": [preset.video.height, preset.video.width],
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "load_average_1m": os.getloadavg()[0],  # others' work on a shared machine slows both sides
           "vae_decode_block_s": t_decode, "reward_batched_block_s": t_batched,
           "reward_per_frame_loop_block_s": t_loop, "batched_speedup": t_loop / t_batched,
           "note": "the loop is sdvg's scorer called once per uint8 frame; the image-reward package is not "
                   "installed in the runtime (it runs only on transformers <= 4.55.4)"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
