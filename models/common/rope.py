"""Rotary position embedding, "rotate half" layout (Llama/Qwen)."""

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, S, head_dim] for integer positions [B, S].

    NOTE: computed from the real positions each forward (cheap: head_dim/2 frequencies), so
    a sequence split across ranks (context parallelism, zigzag order) gets the right angles,
    and there is no buffer to materialise after meta-device construction.
    """
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
    angles = position_ids.float()[..., None] * inv_freq  # [B, S, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)  # [B, S, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, heads, head_dim]; cos/sin: [B, S, head_dim]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin
