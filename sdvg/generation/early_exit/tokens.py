"""The token layout of early exit: a token is one patch (1 x 2 x 2 latent cells, all channels) of one
latent frame, in the DiT's order (frame, row, column), so token i of a block is row i of its sequence."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def to_tokens(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """latents [1, C, F, H, W] -> tokens [F*gh*gw, C*pt*ph*pw] (float32)."""
    _, C, nF, H, W = latents.shape
    pt, ph, pw = patch
    x = latents[0].float().reshape(C, nF // pt, pt, H // ph, ph, W // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape((nF // pt) * (H // ph) * (W // pw), -1)


def token_grid(shape: tuple[int, ...], patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """(frames, rows, columns) of the token grid of latents of `shape` [1, C, F, H, W]."""
    return shape[2] // patch[0], shape[3] // patch[1], shape[4] // patch[2]


def token_mask_to_latents(mask: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """A per-token bool [S] -> a bool mask broadcastable to latents of `shape`: [1, 1, F, H, W]."""
    gf, gh, gw = token_grid(shape, patch)
    pt, ph, pw = patch
    grid = mask.reshape(gf, gh, gw)
    grid = grid.repeat_interleave(pt, 0).repeat_interleave(ph, 1).repeat_interleave(pw, 2)
    return grid[None, None]


def token_norms(tokens: torch.Tensor) -> torch.Tensor:
    """[S, D] -> the L2 norm of each token [S]."""
    return torch.linalg.vector_norm(tokens, dim=-1)


def gaussian_taps(size: int, sigma: float, device) -> torch.Tensor:
    half = size // 2
    x = torch.arange(-half, half + 1, dtype=torch.float32, device=device)
    taps = torch.exp(-(x * x) / (2.0 * sigma * sigma))
    return taps / taps.sum()


SPATIAL_KERNEL, TEMPORAL_KERNEL, SMOOTH_SIGMA = 9, 3, 1.0


def smooth_scores(scores: torch.Tensor, sigma: float = SMOOTH_SIGMA) -> torch.Tensor:
    """Gaussian smoothing of token scores over space and time: [F, gh, gw] -> [F, gh, gw].

    Separable: a 9-tap spatial kernel along rows and columns (9x9, sigma 1.0, as Speculative Forcing)
    and a 3-tap temporal one (sigma 1.0) across the block's latent frames; borders replicate the edge
    value. Non-finite scores (no history to compare with) stay non-finite where they reach."""
    x = scores.float()[None, None]  # [1, 1, F, gh, gw]
    for dim, size in ((2, TEMPORAL_KERNEL), (3, SPATIAL_KERNEL), (4, SPATIAL_KERNEL)):
        taps = gaussian_taps(size, sigma, x.device)
        shape = [1, 1, 1, 1, 1]
        shape[dim] = size
        pad = [0, 0, 0, 0, 0, 0]  # (w_lo, w_hi, h_lo, h_hi, f_lo, f_hi)
        lo = 2 * (4 - dim)
        pad[lo] = pad[lo + 1] = size // 2
        x = F.conv3d(F.pad(x, pad, mode="replicate"), taps.reshape(shape))
    return x[0, 0]


def nearest_distance(queries: torch.Tensor, keys: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """min over keys of ||q - k||_2 for each query: [A, D], [N, D] -> [A] (inf when N = 0); keys in chunks
    so that the [A, chunk] distance matrix stays small at real size."""
    best = torch.full((queries.shape[0],), math.inf, device=queries.device)
    for start in range(0, keys.shape[0], chunk):
        d = torch.cdist(queries[None].float(), keys[None, start:start + chunk].float())[0]  # [A, chunk]
        best = torch.minimum(best, d.min(dim=1).values)
    return best
