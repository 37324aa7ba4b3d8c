"""A router's fp32 logits from a bf16 input, keeping the bf16 input for backward.

Routers compute in fp32 (discrete top-k choices must not flip with bf16 rounding), so
`F.linear(x.float(), w)` casts a [T, dim] input up first, and autograd keeps that fp32
copy for the weight's gradient: 4 bytes a value where the bf16 input, which the layer
keeps anyway (or rebuilds: `selective` recomputes the norm that made it), holds the same
values in 2. At DeepSeek-V3's width that copy is 28,672 bytes a token and MoE block.
`fp32_linear` computes the same products and keeps the input as it came; its backward
casts it again. The cast is exact, so forward and gradients are bitwise autograd's.

NOTE: FSDP must not cast the router's inputs (its fp32 unit is built with
`cast_forward_inputs=False`, moetrain/parallelisms/fsdp.py), or the copy is made there, outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _Fp32Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # linear's input gradient, then the cast's (back to x's)
            grad_x = grad.matmul(weight.float()).to(x.dtype)
        flat = grad.reshape(-1, grad.shape[-1])  # [T, out]
        if ctx.needs_input_grad[1]:
            # (grad^T @ x, as autograd's mm does it for the transposed weight: the same sums)
            grad_w = flat.t().mm(x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


def fp32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x.float(), weight.float(), bias.float())` -> fp32 [..., out], keeping `x`
    (not its fp32 copy) for backward."""
    if x.dtype == torch.float32:  # nothing to save: the plain op
        return F.linear(x, weight.float(), None if bias is None else bias.float())
    return _Fp32Linear.apply(x, weight, bias)
