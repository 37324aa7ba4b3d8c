"""The routed experts' GEMMs in FP8 (`train.fp8`): `Float8GroupedExperts`.

Rows (tokens) are scaled one by one in both recipes: under expert parallelism an expert's
rows come from other ranks' micro-batches, so a scale over several rows would depend on
the layout, and the grouped FP8 kernel, `torch._scaled_grouped_mm`, takes per-row scales
of its rows' operand. The weights: `rowwise`, a scale per output channel of each expert
(per input channel for the input gradient); `tensorwise`, one scale per expert's matrix.
Forward and input gradient run in e4m3 (the grouped kernel's format); the weight gradient,
a contraction over each expert's rows, in the compute dtype (`grouped_mm_wgrad`), as in
the linear layers' rowwise recipe (moetrain/models/common/float8.py).

Kernels: `torch._scaled_grouped_mm` on CUDA; elsewhere (it has no CPU kernel) one
`torch._scaled_mm` per expert, the same arithmetic. Both run inside one custom op, so
torch.compile keeps the GEMM as one call (as `moetrain::grouped_mm` does) and compiled
and eager numbers are the same.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from moetrain.models.common.float8 import E4M3, RECIPES, quantize
from moetrain.models.common.grouped_gemm import grouped_mm_supported, grouped_mm_wgrad
from moetrain.models.common.moe import GroupedExperts


def _column_major(b: torch.Tensor) -> torch.Tensor:
    return b.transpose(-2, -1).contiguous().transpose(-2, -1)


def _quantized_weight(w: torch.Tensor, weight_scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] in e4m3 (column-major) and its scales [E, N]: per (expert, column) over
    K (rowwise), or one per expert broadcast over its columns (tensorwise)."""
    if weight_scaling == "rowwise":
        wq, ws = quantize(w, E4M3, -2)  # [E, 1, N]
    else:
        wq, ws = quantize(w, E4M3, (-2, -1))  # [E, 1, 1]
        ws = ws.expand(-1, 1, w.shape[-1])
    return _column_major(wq), ws.squeeze(-2).contiguous()


@torch.library.custom_op("moetrain::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, weight_scaling: str
) -> torch.Tensor:
    """x [T, K] expert-major @ w [E, K, N] per expert -> [T, N] in x's dtype, both operands
    in e4m3: x per row, w by `weight_scaling` (module docstring)."""
    xq, xs = quantize(x, E4M3, -1)  # [T, 1]
    wq, ws = _quantized_weight(w, weight_scaling)
    if x.device.type == "cuda":
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        return torch._scaled_grouped_mm(xq, wq, xs.squeeze(-1), ws, offs=offsets, out_dtype=x.dtype)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, rows in enumerate(tokens_per_expert.tolist()):  # host read: a loop needs sizes
        if rows:
            end = start + rows
            out[start:end] = torch._scaled_mm(
                xq[start:end], wq[e], xs[start:end], ws[e : e + 1], out_dtype=x.dtype
            )
            start = end
    return out


@fp8_grouped_mm.register_fake
def _(x, w, tokens_per_expert, weight_scaling):
    return x.new_empty((x.shape[0], w.shape[-1]))


def _setup(ctx, inputs, output) -> None:
    x, w, tokens_per_expert, weight_scaling = inputs
    ctx.save_for_backward(x, w, tokens_per_expert)
    ctx.weight_scaling = weight_scaling


def _backward(ctx, grad):
    x, w, tokens_per_expert = ctx.saved_tensors
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:  # dy per row, w^T scaled along its new contraction dim
        dx = fp8_grouped_mm(grad, w.transpose(-2, -1), tokens_per_expert, ctx.weight_scaling)
    if ctx.needs_input_grad[1]:  # in the compute dtype (module docstring)
        impl = "grouped_mm" if grouped_mm_supported(x, w) else "loop"
        x = x.to(grad.dtype)
        if w.stride(-2) == 1:  # w a transposed view of nn.Linear's [E, N, K]: dw in its layout
            dw = grouped_mm_wgrad(grad, x, tokens_per_expert, impl).transpose(-2, -1)
        else:
            dw = grouped_mm_wgrad(x, grad, tokens_per_expert, impl)
        dw = dw.to(w.dtype)
    return dx, dw, None, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup)


class Float8GroupedExperts(GroupedExperts):
    """GroupedExperts whose two stacked projections run in FP8 (`fp8_grouped_mm`)."""

    def __init__(
        self, num_experts: int, dim: int, hidden_dim: int, recipe: str, gemm: str = "auto"
    ) -> None:
        super().__init__(num_experts, dim, hidden_dim, gemm)
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {RECIPES}")
        self.recipe = recipe

    @classmethod
    def around(cls, experts: GroupedExperts, recipe: str) -> Float8GroupedExperts:
        """A Float8GroupedExperts holding `experts`' own stacked weights."""
        E, two_hidden, dim = experts.gate_up_proj.shape
        with torch.device(experts.gate_up_proj.device):
            new = cls(E, dim, two_hidden // 2, recipe, experts.gemm)
        new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
        return new

    def project(self, x: torch.Tensor, name: str, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w = getattr(self, f"{name}_proj")
        if isinstance(w, DTensor):  # under expert parallelism: this rank's experts
            w = w.to_local()
        return fp8_grouped_mm(x, w.transpose(-2, -1), tokens_per_expert, self.recipe)

    def extra_repr(self) -> str:
        return f"fp8={self.recipe}"
