"""A start frame (Krea's `start_frame`): an image that every role sees as clean context before block 0.

Krea (`release_server.py`, `setup_start_frame` and `recompute_kv_cache`) repeats the image
`1 + (kv_cache_num_frames - 1) * 4` times, encodes that clip with the VAE (the causal encoder's first
chunk one frame, then chunks of 4: `kv_cache_num_frames` latent frames), writes the latents at latent
frames 0 .. kv - 1 and starts generating at frame kv: block 0 is denoised after them, its context the
start latents (latent frame 0 first, as any recompute context), and they are never decoded nor sent.

sdvg does the same for every role (docs/live.md, "Start frame"): a `recompute` role takes the start
latents as its recorded context (frame 0 and the last kv - 1), a `full` role commits them with one
t = 0 forward at frames 0 .. kv - 1; either way block b then sits at latent frame kv + 3 b. The block
noise stays each block's own draw ((seed, block)): it does not move with the offset, as Krea's slice of
one seeded noise tensor does (docs/method.md, "Noise")."""
from __future__ import annotations

import os

import numpy as np
import torch

from sdvg.io.video_input import VideoInputError, check_frames, check_image_header, fit_frames, open_image


def start_frame_image(source) -> np.ndarray:
    """The start frame as uint8 [H, W, 3]: an image file's path (JPEG, PNG or WebP, opened by PIL under its
    pixel limit), a PIL image, or uint8 pixels [H, W, 3] (numpy or torch)."""
    if isinstance(source, (str, os.PathLike)):
        return _read_image(source)
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a runtime requirement
        Image = None
    if Image is not None and isinstance(source, Image.Image):
        check_image_header(source)  # an image opened lazily is checked before its pixels are decoded
        source = np.asarray(source.convert("RGB"))  # alpha, palettes, greyscale: to RGB as Krea's convert does
    if isinstance(source, (np.ndarray, torch.Tensor)):
        shape = list(source.shape)
        if len(shape) != 3 or shape[-1] != 3:
            hint = "; a channels-first image [3, H, W] becomes one with .permute(1, 2, 0) (torch) or " \
                   ".transpose(1, 2, 0) (numpy)" if len(shape) == 3 and shape[0] == 3 else ""
            raise VideoInputError(f"start_frame must be one RGB image, uint8 [H, W, 3], got shape {shape}{hint}")
        return check_frames(source[None], "start_frame")[0]
    raise TypeError(f"start_frame must be an image file's path, a PIL image or uint8 pixels [H, W, 3], got "
                    f"{type(source).__name__}")


def _read_image(path) -> np.ndarray:
    """An image file -> uint8 RGB [H, W, 3]; JPEG, PNG and WebP only, its size read from the header and checked
    (`open_image`: at most MAX_SIDE a side, MAX_PIXELS in all) before a pixel is decoded; PIL's
    decompression-bomb warning or error is never reached (a bigger image is refused here, by name)."""
    if not os.path.isfile(path):
        raise VideoInputError(f"start_frame {os.fspath(path)} does not exist or is not a file; give an image file "
                              "(JPEG, PNG or WebP)")
    where = f"start_frame {os.fspath(path)}"
    try:
        with open_image(path, where=where) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    except VideoInputError:
        raise
    except Exception as exc:  # PIL's many decode errors (a truncated file, a corrupt stream)
        raise VideoInputError(f"{where} is not a readable JPEG, PNG or WebP image ({type(exc).__name__}: "
                              f"{exc})") from None


def start_frame_pixels(image: np.ndarray, kv_cache_frames: int, height: int, width: int,
                       temporal_stride: int = 4) -> torch.Tensor:
    """Krea's clip: the image fitted to the video's size (video input's rule: cover, centre-crop) and repeated
    1 + (kv - 1) * stride times -> [1, 3, T, height, width] in [-1, 1]."""
    frames = 1 + (kv_cache_frames - 1) * temporal_stride
    one = fit_frames(np.array(image[None]), height, width)  # [1, 3, H, W] (a copy: the image may be read-only)
    return one.permute(1, 0, 2, 3)[None].expand(1, 3, frames, height, width).contiguous()


def start_latents(image: np.ndarray, vae, preset, kv_cache_frames: int) -> torch.Tensor:
    """The start frame's clean latents [1, z, kv_cache_frames, h, w] (float32, normalised, on the VAE's device):
    Krea's clip encoded by the streaming encoder from a fresh cache (diffusers' whole-clip chunks)."""
    from sdvg.models.vae_encoder import StreamingVAEEncoder

    encoder = StreamingVAEEncoder(vae)
    v = preset.video
    pixels = start_frame_pixels(image, kv_cache_frames, v.height, v.width, encoder.temporal_stride)
    latents = encoder.encode(pixels, encoder.new_cache())
    if latents.shape[2] != kv_cache_frames:  # the encoder's own rule; a guard for a VAE of another stride
        raise ValueError(f"the start frame encoded to {latents.shape[2]} latent frames, expected {kv_cache_frames}")
    return latents

