"""The fast VAE decode (`fast_vae=True`; backend eager): the same streaming decode with

- the decoder's conv weights and activations in channels-last memory (`torch.channels_last_3d` for
  the causal 3-D convs, `torch.channels_last` for the 2-D convs of the upsamplers), on a copy of the
  decoder made once per pipeline (the pipeline's own VAE is left as it is, so the plain decode and
  `decode_video` stay bitwise what they were);
- `torch.backends.cudnn.benchmark` on (CUDA): set once per process, by the first video that asks for
  `fast_vae` on a CUDA device (`enable_cudnn_benchmark`, from `prepare` on the main thread, before
  the scheduler starts), and left on; never toggled per decode or from a stage thread, where it
  could change while the other role captures a CUDA graph or plans a conv;
- the steady-state decode (one latent frame with a full causal cache: from the third latent frame
  of a video on, every shape static) through `torch.compile(VAEDecodeStep, dynamic=False)`, compiled
  once per pipeline; the first frames of a video (the cache's first-frame markers) run eagerly.

The result is not bitwise the plain decode: channels-last (and cudnn's benchmarked algorithms)
sum in another order. The difference stays within `FAST_VAE_TOLERANCE` (max absolute, pixels in
[-1, 1]; tests/test_fast_vae.py measures it on the CPU). Pixels feed the reward model, so a score
near tau may decide the other way; compare fast and plain runs within the tolerance, not bitwise.

cudnn.benchmark is process-wide: once on, every later cuDNN conv of the process is planned with it,
the DiTs' patch-embedding convs included (graphs captured before that keep the algorithm they were
captured with). A process that must give bitwise the videos of one that never used `fast_vae` on
CUDA runs without it."""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn

from sdvg.engines.modules import VAEDecodeStep, vae_decode_static

# max |fast - plain| of decoded pixels in [-1, 1], per decoder dtype (fp32 measured on the CPU:
# see tests/test_fast_vae.py; fp16/bf16 follow the onnxruntime table's frames row, 4 and 8 uint8 steps)
FAST_VAE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4 / 127.5, torch.bfloat16: 8 / 127.5}


_BENCHMARK_SET = False


def enable_cudnn_benchmark() -> None:
    """`torch.backends.cudnn.benchmark = True` for the rest of the process, once (later calls do nothing).
    Call from the main thread before a scheduler starts (`StageRunners.use_fast_vae`)."""
    global _BENCHMARK_SET
    if not _BENCHMARK_SET:
        torch.backends.cudnn.benchmark = True
        _BENCHMARK_SET = True


@contextmanager
def cudnn_benchmark(on: bool = True):
    """`torch.backends.cudnn.benchmark = on` for the block's duration, the previous value restored. Kept for
    callers outside the hot loop; the fast decode no longer toggles it (`enable_cudnn_benchmark`)."""
    prev = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = prev


def channels_last(module: nn.Module) -> nn.Module:
    """Every 5-D parameter in `torch.channels_last_3d`, every 4-D one in `torch.channels_last` (in place)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 5:
                p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
            elif p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
    return module


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """A 5-D tensor in channels-last memory with the canonical strides (no copy when it already is, up to
    the strides of size-1 dimensions, which a compiled step would otherwise guard on and recompile for)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return x
    if not x.is_contiguous(memory_format=torch.channels_last_3d):
        x = x.contiguous(memory_format=torch.channels_last_3d)
    _, c, d, h, w = x.shape
    strides = (c * d * h * w, 1, h * w * c, w * c, c)
    return x if x.stride() == strides else x.as_strided(x.shape, strides)


class _DecoderOnly(nn.Module):
    """The two modules of a Wan VAE the decode uses (`post_quant_conv`, `decoder`), as copies."""

    def __init__(self, vae):
        super().__init__()
        self.post_quant_conv = copy.deepcopy(vae.post_quant_conv)
        self.decoder = copy.deepcopy(vae.decoder)


class FastVAEDecode:
    """`decode(latents, cache)` as `StreamingVAEDecoder.decode`, the fast way (module docstring).
    `compile=False` keeps the steady state eager (channels-last and cudnn.benchmark only); `compile_fn`
    (module -> compiled module) replaces the default `torch.compile(module, dynamic=False)`.
    On CUDA, making one sets cudnn.benchmark for the process (`enable_cudnn_benchmark`)."""

    def __init__(self, decoder, compile: bool = True, compile_fn=None):
        self.plain = decoder
        self.fast = copy.copy(decoder)  # the same latent statistics and conv count, its own modules
        self.fast.vae = channels_last(_DecoderOnly(decoder.vae)).eval()
        self.compile = compile
        # how the steady state is compiled (the compile backend's settings); default: torch.compile, static shapes
        self.compile_fn = compile_fn or (lambda module: torch.compile(module, dynamic=False))
        self._step = None  # the compiled steady-state step, made by the first steady frame
        if self.fast.device.type == "cuda":
            enable_cudnn_benchmark()

    def _steady(self, cache):
        if self._step is None:
            step = VAEDecodeStep.for_cache(self.fast, cache).eval()
            self._step = self.compile_fn(step) if self.compile else step
        return self._step

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cache) -> torch.Tensor:
        pixels = vae_decode_static(
            lambda frame, *entries: self._steady(cache)(*(to_channels_last(t) for t in (frame, *entries))),
            _FirstFrames(self.fast), latents, cache)
        return pixels.contiguous()


class _FirstFrames:
    """The eager decode of the first frames (`vae_decode_static` calls `.decode` and `.device`),
    its input in channels-last memory."""

    def __init__(self, fast):
        self.fast = fast

    @property
    def device(self):
        return self.fast.device

    def decode(self, frame, cache):
        return self.fast.decode(to_channels_last(frame), cache)
