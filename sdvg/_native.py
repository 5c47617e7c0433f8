"""Import point of the compiled core (torch must be imported first: _C links against it)."""
import torch  # noqa: F401

try:
    from sdvg import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "sdvg._C is not built: run `pip install --no-build-isolation -e .` in the sdvg checkout "
        f"(torch, pybind11 and ninja must be installed first). Cause: {exc}"
    ) from exc

__all__ = ["_C"]
