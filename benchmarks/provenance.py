"""Provenance recorded in every benchmark results file: the commit, how sdvg._C was built, the
torch / CUDA / cuDNN versions, the device, the seed and prompt of the runs and the TF32 flags.

The commit is the project's own (`commit_of`): git's when the project root is a git checkout's toplevel,
$SDVG_COMMIT for a tree copied without its .git, else "unknown"."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the project root: the folder that holds sdvg/ and benchmarks/
COMMIT_VARIABLE = "SDVG_COMMIT"  # the commit of a tree copied without its .git (benchmarks/gpu_check.sh sets it)


def _git(*args, root: Path = ROOT) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit_of(root: Path = ROOT) -> dict:
    """`commit`, `dirty` and `commit_source` of the project tree at `root`. $SDVG_COMMIT, when set, names it
    (the caller knows which commit it copied; a copied tree may carry a stale .git, as a lent GPU machine's
    copy did: git's HEAD is then kept as `git_head`). Else git's answer when git's toplevel is `root`
    itself (a tree copied without its .git into a folder of another repository would otherwise report
    that repository's HEAD), else "unknown" (dirty None: not known either way)."""
    top = _git("rev-parse", "--show-toplevel", root=root)
    own = top is not None and Path(top).resolve() == Path(root).resolve()
    named = os.environ.get(COMMIT_VARIABLE, "").strip()
    if named:
        return {"commit": named, "dirty": None, "commit_source": COMMIT_VARIABLE,
                "git_head": _git("rev-parse", "HEAD", root=root) if own else None}
    if own:
        status = _git("status", "--porcelain", "--untracked-files=no", root=root)
        return {"commit": _git("rev-parse", "HEAD", root=root) or "unknown",
                "dirty": bool(status) if status is not None else None, "commit_source": "git"}
    return {"commit": "unknown", "dirty": None, "commit_source": None}


def provenance(seed=None, prompt=None, device=None) -> dict:
    from sdvg._native import _C

    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    return {
        **commit_of(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "sdvg_C_build": {k: v for k, v in _C.build_info().items()},
        # gpu_check.sh: the CUDA_HOME it derived from nvcc, or why it fell back to the CPU build
        "build_note": os.environ.get("SDVG_BUILD_NOTE"), "cuda_home": os.environ.get("CUDA_HOME"),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "device": str(dev) if dev is not None else None,
        "device_name": torch.cuda.get_device_name(dev) if cuda else (platform.processor() or "cpu"),
        "capability": list(torch.cuda.get_device_capability(dev)) if cuda else None,
        "seed": seed, "prompt": prompt,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()},
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def provenance_line(p: dict) -> str:
    """One Markdown line of a provenance dict, for the results.md files."""
    tf32 = p["tf32"]
    source = f" (from {p['commit_source']})" if p.get("commit_source") not in (None, "git") else ""
    return (f"commit `{p['commit']}`{' (dirty)' if p['dirty'] else ''}{source}; sdvg._C {p['sdvg_C_build']}"
            f"{'; ' + p['build_note'] if p['build_note'] else ''}; torch {p['torch']} (CUDA {p['torch_cuda']}, "
            f"cuDNN {p['cudnn']}); {p['device_name']}; seed {p['seed']}; prompt {p['prompt']!r}; TF32 matmul "
            f"{tf32['matmul']}, cuDNN {tf32['cudnn']}")
