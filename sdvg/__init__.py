"""sdvg: speculative decoding for block-autoregressive video diffusion."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sdvg.config import PRESETS, ConfigError, Preset, get_preset
from sdvg.pipeline import PipelineOutput, SpeculativeVideoPipeline

__all__ = ["SpeculativeVideoPipeline", "PipelineOutput", "PRESETS", "Preset", "get_preset", "ConfigError"]
__version__ = "0.1.0"
