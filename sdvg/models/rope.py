"""3-axis rotary position embedding of Wan2.1 with an absolute latent-frame offset."""
from __future__ import annotations

import torch


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """(frame, height, width) split of one head's channels, as in Wan2.1."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def rope_angles(head_dim: int, max_positions: int, theta: float = 10000.0) -> torch.Tensor:
    """Angles [max_positions, head_dim // 2] (float64): per axis, pos * theta^(-2i/dim)."""
    parts = []
    for dim in rope_axis_dims(head_dim):
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        parts.append(torch.outer(torch.arange(max_positions, dtype=torch.float64), inv))
    return torch.cat(parts, dim=1)


def rope_cos_sin(angles: torch.Tensor, head_dim: int, frame_offset: int, frames: int, height: int, width: int,
                 device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, head_dim // 2] for tokens of frames [frame_offset, frame_offset + frames) on a height x width
    token grid, in (frame, row, column) token order."""
    t_dim, h_dim, _ = (d // 2 for d in rope_axis_dims(head_dim))
    if frame_offset + frames > angles.shape[0]:
        raise ValueError(f"frame {frame_offset + frames} exceeds the RoPE table ({angles.shape[0]} positions)")
    a_t = angles[frame_offset:frame_offset + frames, :t_dim]
    a_h = angles[:height, t_dim:t_dim + h_dim]
    a_w = angles[:width, t_dim + h_dim:]
    grid = torch.cat([
        a_t[:, None, None, :].expand(frames, height, width, -1),
        a_h[None, :, None, :].expand(frames, height, width, -1),
        a_w[None, None, :, :].expand(frames, height, width, -1),
    ], dim=-1).reshape(frames * height * width, -1)
    return grid.cos().to(device=device, dtype=dtype), grid.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1). x: [B, S, H, D]; cos/sin: [S, D/2], or [B, S, D/2] (one table per batch
    row: videos at different positions batched together) -> [B, S, H, D] in x's dtype.

    Computed in float32 and rounded once into x's dtype. Eagerly, a bf16 x is widened exactly inside
    each product and each rotated channel is rounded straight into the output (`out=`), so no widened
    copy of x and no stacked fp32 result is made; under torch.compile (which traces no strided `out=`)
    the stacked form, which inductor fuses into one kernel, and with autograd recording (out= is not
    differentiable) too: the same values."""
    pairs = x.unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2] view
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c, s = (cos, sin) if cos.dim() == 3 else (cos[None], sin[None])  # [1 or B, S, D/2]
    c, s = c[:, :, None, :], s[:, :, None, :]
    grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
    if torch.compiler.is_compiling() or grad:  # out= is neither traced nor differentiable: the stacked form
        x1, x2 = x1.float(), x2.float()
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotated = out.unflatten(-1, (-1, 2))
    torch.sub(x1 * c, x2 * s, out=rotated[..., 0])
    torch.add(x1 * s, x2 * c, out=rotated[..., 1])
    return out
