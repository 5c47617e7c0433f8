"""Import point of the compiled core (torch must be imported first: _C links against it), and what its
build is: a CPU-only core on a CUDA device is said at load (`cpu_build_warning`), and every run records the
build (`build_record`, the statistics' `build`)."""
import torch  # noqa: F401

try:
    from sdvg import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "sdvg._C is not built: run `pip install --no-build-isolation -e .` in the sdvg checkout "
        f"(torch, pybind11 and ninja must be installed first). Cause: {exc}"
    ) from exc

__all__ = ["_C", "build_record", "cpu_build_warning"]


def build_record() -> dict:
    """How sdvg._C was built and what it runs on: `native_cuda` (built with CUDA: per-role CUDA streams),
    `native_cuda_runtime` (the CUDA runtime it was compiled against, e.g. "12.8"; null for a CPU build),
    `native_torch` (the torch it was compiled against), `torch_cuda` (the installed torch's CUDA, null for a
    CPU torch)."""
    info = _C.build_info()
    runtime = info.get("cuda_runtime_version")  # CUDART_VERSION: major * 1000 + minor * 10
    return {"native_cuda": bool(info["cuda"]),
            "native_cuda_runtime": None if runtime is None else f"{runtime // 1000}.{runtime % 1000 // 10}",
            "native_torch": info["torch_version"], "torch_cuda": torch.version.cuda}


def cpu_build_warning(devices) -> str | None:
    """The warning of a CPU-only sdvg._C serving a CUDA device (as a `docker build`, where no GPU is visible,
    builds it unless told), or None."""
    cuda = sorted({str(d) for d in devices if torch.device(d).type == "cuda"})
    if not cuda or _C.build_info()["cuda"]:
        return None
    return (f"sdvg._C was built without CUDA (as a build where no GPU is visible makes it), but this pipeline runs on "
            f"{', '.join(cuda)}: the native scheduler runs every role on one stream, so the drafter cannot overlap "
            "the target; rebuild it with CUDA: SDVG_CUDA=1 pip install --no-build-isolation . (nvcc on the PATH or "
            "CUDA_HOME set; TORCH_CUDA_ARCH_LIST for the GPUs, e.g. '8.9;9.0')")
