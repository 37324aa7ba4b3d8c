"""Rotary position embedding: "rotate half" (Llama/Qwen) or interleaved pairs (GPT-J style:
DeepSeek, ERNIE-4.5), with optional YaRN context extension."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class YaRN:
    """YaRN scaling (Peng et al. 2023) as Hugging Face's `rope_type: yarn` computes it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: unset (Hugging Face's None)
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def attention_factor(self) -> float:
        """Scale of cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_of(args: Any) -> YaRN | None:
    """The YaRN scaling a model's args ask for (`rope_type = "yarn"` and its `rope_*`
    keys, moetrain.models.common.rope_args), None for plain RoPE; keys a model lacks keep YaRN's
    defaults."""
    if getattr(args, "rope_type", "default") != "yarn":
        return None
    return YaRN(
        factor=args.rope_factor,
        original_max_position_embeddings=args.rope_original_max_position_embeddings,
        beta_fast=args.rope_beta_fast,
        beta_slow=args.rope_beta_slow,
        mscale=getattr(args, "rope_mscale", 0.0),
        mscale_all_dim=getattr(args, "rope_mscale_all_dim", 0.0),
        truncate=args.rope_truncate,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(
    head_dim: int, theta: float, yarn: YaRN | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The head_dim/2 rotation frequencies, YaRN-blended between interpolated and
    extrapolated ones when `yarn` is given."""
    arange = torch.arange(0, head_dim, 2, device=device).float()
    pos_freqs = theta ** (arange / head_dim)  # [head_dim / 2]
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:  # dim whose wavelength fits `rotations`
        base_len = yarn.original_max_position_embeddings
        return head_dim * math.log(base_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((arange / 2 - low) / (high - low)).clamp(0, 1)  # dim index 0 .. head_dim/2 - 1
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    yarn: YaRN | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, S, head_dim] for integer positions [B, S].

    NOTE: computed from the real positions each forward (cheap: head_dim/2 frequencies), so
    a sequence split across ranks (context parallelism, zigzag order) gets the right angles,
    and there is no buffer to materialise after meta-device construction.
    """
    # Built on the positions' device: no host-to-device copy in every forward.
    inv_freq = rope_inv_freq(head_dim, theta, yarn, position_ids.device)
    angles = position_ids.float()[..., None] * inv_freq  # [B, S, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)  # [B, S, head_dim]
    scale = yarn.attention_factor() if yarn is not None else 1.0
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, heads, head_dim]; cos/sin: [B, S, rope_dim], rope_dim <= head_dim.

    Partial rotary (GLM-4.5's `partial_rotary_factor`): with rope_dim < head_dim only the
    first rope_dim dims of each head rotate ("rotate half" among them), the rest pass."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rope_dim = cos.shape[-1]
    if rope_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J-style RoPE: rotate the adjacent pairs (x0, x1), (x2, x3), ... of each head, pair
    i by frequency i. x: [B, S, heads, D]; cos/sin: [B, S, D] from `rope_cos_sin` (its two
    equal halves; the first is used). For any model whose checkpoint pairs adjacent dims:
    DeepSeek-V3 (`rope_interleave`), ERNIE-4.5 (always), GPT-J, GPT-NeoX's `rotary_interleaved`.

    The result is returned de-interleaved (the rotated evens, then the rotated odds), not in
    the input's order. Apply it to q and to k alike and to nothing else: both get the same
    permutation of their last dim, so every q.k product, and so the attention, is that of
    the interleaved rotation (tests/test_model_units.py), while v is never permuted. A
    caller that needs the rotated vector itself in the input's order must re-interleave."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
