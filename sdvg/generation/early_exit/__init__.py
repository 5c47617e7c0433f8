"""Token-level early exit of the denoising loop (Speculative Forcing): the loop (`loop.py`), the exit
record of one denoise (`record.py`), token layout helpers (`tokens.py`) and one file per verifier."""
from sdvg.generation.early_exit.loop import ExitPlan, denoise_with_exit, make_verifier  # noqa: F401
from sdvg.generation.early_exit.record import ExitRecord  # noqa: F401
