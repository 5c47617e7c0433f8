"""Copy kernels and kernel launches per DiT forward, by operator class and by call site, counted on the CPU
with a dispatch hook (what each aten operator of one forward would launch on a GPU; views, `empty*` and
other metadata-only operators launch nothing).

    python benchmarks/copy_counts.py --preset cpu-bench --out results/copy-counts-cpu/after
    PYTHONPATH=<an older checkout> python benchmarks/copy_counts.py ... --out results/copy-counts-cpu/before

Counted per role (drafter, target) over one cached block forward (3 new frames, the previous block's
frames visible in the cache, `attend` writing the block's K/V) and, for the target, its recompute
context forward (kv_cache_frames clean frames, block-causal): each operator's class (copy, gemm,
attention, norm, elementwise), the copy operators by call site (the innermost sdvg frame), and the
totals per forward and per transformer block. On the CPU some operators decompose differently than on
CUDA (the q/k RMSNorm is one fused kernel on CUDA, several here); the copy sites are the same.
Writes results.json (with provenance) and results.md."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance, provenance_line  # noqa: E402
from sdvg.config import get_preset  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from sdvg.models.kv_cache import KVCacheSpec  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "_local_scalar_dense", "set_", "resize_", "is_same_size", "record_stream", "alias"}
COPY = {"_to_copy", "copy_", "clone", "cat", "stack", "index_select", "index_copy_", "index_put_", "_unsafe_index",
        "contiguous", "repeat", "gather"}
GEMM = {"addmm", "mm", "bmm", "baddbmm", "linear", "_scaled_mm", "convolution"}
NORM = {"native_layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm"}


def op_class(name: str) -> str:
    if name in COPY:
        return "copy"
    if name in GEMM:
        return "gemm"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in NORM:
        return "norm"
    return "elementwise"


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_class, self.copy_sites, self.ops = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            cls = op_class(name)
            self.by_class[cls] += 1
            self.ops[name] += 1
            if cls == "copy":
                frames = [f for f in traceback.extract_stack() if "/sdvg/" in f.filename]
                where = f"{frames[-1].filename.split('/sdvg/')[-1]}:{frames[-1].lineno} {frames[-1].line}" \
                    if frames else "(outside sdvg)"
                self.copy_sites[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def count_forward(dit, text, cache, latents, timesteps, attn_mask=None) -> dict:
    with torch.no_grad(), Count() as c:
        dit(latents, timesteps, text, cache=cache, attn_mask=attn_mask)
    layers = dit.config.num_layers
    launches = sum(c.by_class.values())
    return {"launches": launches, "copies": c.by_class["copy"], "by_class": dict(c.by_class),
            "launches_per_layer": round(launches / layers, 2), "copies_per_layer": round(c.by_class["copy"] / layers, 2),
            "copy_sites": [{"op": op, "site": site, "count": n} for (op, site), n in c.copy_sites.most_common()],
            "ops": dict(c.ops.most_common())}


def measure(preset_name: str, precision: str, seed: int = 0) -> dict:
    preset = get_preset(preset_name).replace(precision=precision)
    comps = build_random(preset, seed=seed, need_reward=False)
    fpb = preset.video.frames_per_block
    out = {}
    for role in ("drafter", "target"):
        dit = getattr(comps, role)
        tpf = preset.video.tokens_per_frame(preset.vae, dit.config)
        h, w = preset.video.latent_hw(preset.vae)
        text = dit.encode_text(torch.randn(1, 8, dit.config.text_dim))
        cache = KVCacheSpec.for_dit(dit.config, tpf, 4 * fpb).allocate(dit.dtype, "cpu")
        block = torch.randn(1, dit.config.in_channels, fpb, h, w)
        t = torch.full((1, fpb), 750.0)
        with torch.no_grad():  # block 0 in the cache, so the counted forward attends to a visible block
            dit(block, torch.zeros(1, fpb), text, cache=cache)
            cache.commit()
        out[role] = {"cached_block_forward": count_forward(dit, text, cache, block, t)}
        if role == "target":
            kv = preset.kv_cache_frames
            ctx = KVCacheSpec.for_dit(dit.config, tpf, 4 * fpb).allocate(dit.dtype, "cpu")
            from sdvg.models.dit import block_causal_mask

            mask = block_causal_mask(None, fpb, tpf, num_frames=kv)
            out[role]["recompute_context_forward"] = count_forward(
                dit, text, ctx, torch.randn(1, dit.config.in_channels, kv, h, w), torch.zeros(1, kv),
                attn_mask=mask if kv > fpb else None)
        out[role]["num_layers"] = dit.config.num_layers
    return out


def write_md(results: dict, path: Path) -> None:
    lines = [f"# Copy kernels and launches per DiT forward ({results['preset']}, {results['precision']}, counted on "
             "the CPU)", "",
             provenance_line(results["provenance"]), "",
             "| role | forward | launches | per layer | copies | per layer | gemm | attention | norm | elementwise |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for role, forwards in results["roles"].items():
        for name, r in forwards.items():
            if name == "num_layers":
                continue
            c = r["by_class"]
            lines.append(f"| {role} | {name} | {r['launches']} | {r['launches_per_layer']} | {r['copies']} | "
                         f"{r['copies_per_layer']} | {c.get('gemm', 0)} | {c.get('attention', 0)} | {c.get('norm', 0)} | "
                         f"{c.get('elementwise', 0)} |")
    lines += ["", "## Copy operators of the target's cached block forward, by call site", "",
              "| op | site | count |", "|---|---|---|"]
    for s in results["roles"]["target"]["cached_block_forward"]["copy_sites"]:
        lines.append(f"| {s['op']} | `{s['site']}` | {s['count']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="the DiTs' precision (bf16: what the GPU runs; fp32 makes every cast a no-op)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/copy-counts-cpu")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    results = {"preset": args.preset, "precision": args.precision,
               "provenance": provenance(seed=args.seed, device="cpu"),
               "roles": measure(args.preset, args.precision, args.seed)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_md(results, out / "results.md")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
