"""FP8 GEMMs with dynamic scaling (`train.fp8`): the quantisation and the linear layers.

A GEMM's inputs are cast to FP8 just before it, each with a scale computed from its own
absolute maximum (amax) at that moment (dynamic scaling, as torchao and torchtitan do it);
the weights stay in their master dtype and only the copies the GEMM reads are FP8. Two
recipes, named by the granularity of the scales:

- `rowwise`: a scale per row of each operand along the contraction dim. Forward
  y = x W^T: x per token, W per output channel; input gradient dx = dy W: dy per token, W
  per input channel; all e4m3. The weight gradient dW = dy^T x contracts over the tokens,
  so a scale along it would depend on which tokens a layout puts in one GEMM: it runs in
  the compute dtype (torchao's `rowwise_with_gw_hp`).
- `tensorwise`: one scale per operand. x and W e4m3, dy e5m2 (more range, for gradients);
  all three GEMMs in FP8, the weight gradient from the forward's FP8 x. A tensor split over
  ranks (context parallelism cuts one micro-batch's sequence) takes the amax over all its
  parts: `amax_group` all-reduces it (MAX), so every rank scales as one process would.

Scales are powers of two (the largest that keeps the amax inside the format): the scaled
value is exact before its rounding to FP8, and a scale does not move with the last bits
of an amax. The GEMM is `torch._scaled_mm` (CUDA with compute capability 8.9+; CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("rowwise", "tensorwise")
# The smallest amax a scale is taken from: an all-zero row quantises to zeros.
AMAX_FLOOR = 1e-12


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The multiplier that brings `amax` (fp32) into `dtype`'s range: 2^floor(log2(max /
    amax)), read from the exponent bits (exact, the same in eager and compiled code)."""
    ratio = torch.finfo(dtype).max / amax.float().clamp_min(AMAX_FLOOR)
    exponent = (ratio.view(torch.int32) >> 23) & 0xFF  # biased exponent of a normal fp32
    return (exponent << 23).view(torch.float32)


def quantize(
    t: torch.Tensor,
    dtype: torch.dtype,
    dim: int | tuple[int, ...] | None,
    amax_group: dist.ProcessGroup | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in `dtype`, its dequantisation scale, fp32): t ~ q * scale. `dim`: the scale is
    per slice along it (amax over `dim`, kept as a size-1 dim); None: one scale for the
    tensor, its amax first reduced (MAX) over `amax_group` when given. `scale`: use this
    dequantisation scale instead (the forward's, in backward)."""
    if scale is None:
        if dim is None:
            amax = t.detach().abs().amax().float()
            if amax_group is not None:
                amax = _all_reduce_max(amax, amax_group)
        else:
            amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
        multiplier = power_of_two_scale(amax, dtype)
        scale = multiplier.reciprocal()  # a power of two: exact
    else:
        multiplier = scale.reciprocal()
    limit = torch.finfo(dtype).max
    q = (t.float() * multiplier).clamp(-limit, limit).to(dtype)
    return q, scale


def _all_reduce_max(amax: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    amax = amax.clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) with FP8 a [M, K] (row-major) and b [K, N] (laid out
    column-major here, as the CUDA kernels require); scales [M, 1] and [1, N], or scalars."""
    b = b.t().contiguous().t()
    return torch._scaled_mm(
        a.contiguous(), b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
    )


class Float8Matmul(torch.autograd.Function):
    """x [M, K] @ w[N, K]^T in FP8 under `recipe` (module docstring); w in any dtype."""

    @staticmethod
    def forward(ctx, x, w, recipe: str, amax_group):
        if recipe == "rowwise":
            xq, xs = quantize(x, E4M3, -1)
            wq, ws = quantize(w, E4M3, -1)  # [N, 1]: per output channel
            ctx.save_for_backward(x, w)
            ws = ws.t()
        else:
            xq, xs = quantize(x, E4M3, None, amax_group)
            wq, ws = quantize(w, E4M3, None)  # the whole (gathered) weight
            ctx.save_for_backward(xq, xs, w, ws)
        ctx.recipe, ctx.amax_group, ctx.x_dtype = recipe, amax_group, x.dtype
        return scaled_mm(xq, wq.t(), xs, ws, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        dx = dw = None
        if ctx.recipe == "rowwise":
            x, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                dyq, dys = quantize(dy, E4M3, -1)
                wtq, wts = quantize(w.t(), E4M3, -1)  # [K, 1]: per input channel
                dx = scaled_mm(dyq, wtq.t(), dys, wts.t(), ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dw = (dy.t() @ x.to(dy.dtype)).to(w.dtype)
        else:
            xq, xs, w, ws = ctx.saved_tensors
            dyq, dys = quantize(dy, E5M2, None, ctx.amax_group)
            if ctx.needs_input_grad[0]:
                wq, _ = quantize(w, E4M3, None, scale=ws)
                dx = scaled_mm(dyq, wq, dys, ws, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dw = scaled_mm(dyq.t(), xq, dys, xs, w.dtype)
        return dx, dw, None, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: str,
    amax_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with the GEMM in FP8; x [..., K], weight [N, K]."""
    y = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, amax_group)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class Float8Linear(nn.Linear):
    """An nn.Linear whose GEMM runs in FP8 (`float8_linear`); the same weight and bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        recipe: str,
        amax_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias)
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {RECIPES}")
        self.recipe, self.amax_group = recipe, amax_group

    @classmethod
    def around(
        cls, linear: nn.Linear, recipe: str, amax_group: dist.ProcessGroup | None = None
    ) -> Float8Linear:
        """A Float8Linear holding `linear`'s own weight and bias (the same Parameters)."""
        with torch.device(linear.weight.device):
            new = cls(
                linear.in_features, linear.out_features, linear.bias is not None, recipe, amax_group
            )
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.recipe, self.amax_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe}"
