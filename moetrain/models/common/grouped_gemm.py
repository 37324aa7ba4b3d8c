"""The experts' grouped GEMM: `grouped_mm` picks the kernel (torch's `_grouped_mm` where the
device and dtype allow, else a loop over experts) and, under torch.compile, runs it as one
opaque op.

Why an op: `torch._grouped_mm` runs in fp32 (and fp16) on CPU, but its fake kernel, the
shape function `torch.compile` traces with, copies the CUDA kernel's checks and refuses any
dtype but bf16. So a compiled block fails on the fp32 path. The per-expert loop does not
fail, but its split sizes are a host read (`.tolist()`), which breaks the graph at every
GEMM. In bf16 on CUDA the traced `aten._grouped_mm` compiles, but inductor may hand it
inputs laid out otherwise than eager does (a transposed activation), and the CUDA kernel
then requires every expert's rows to be a 16-byte multiple: a device-side assert in
backward on an H200 (torch 2.11).

`moetrain::grouped_mm` wraps both eager kernels, unchanged, in a custom op with a fake
kernel that only computes the output shape: the compiler keeps it as one call (as it
keeps `aten._grouped_mm` on CPU, an extern kernel), no graph break, and the numbers are
those of eager (same kernel, same inputs, taken row-major as eager's autograd takes them).
Its gradients are the same op on transposed weights (dx) and `moetrain::grouped_mm_wgrad`
(dw): the formulas of `_grouped_mm`'s own autograd, so a compiled step matches an eager
one. Eager runs never reach it.
"""

from __future__ import annotations

import torch


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)


def _loop(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    chunks = torch.split(x, tokens_per_expert.tolist())  # host sync: the loop needs sizes
    return torch.cat([chunk @ w[e] for e, chunk in enumerate(chunks)], dim=0)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # Rows of both operands must start on 16-byte boundaries.
    if any(t.shape[-1] * t.element_size() % 16 for t in (x, w)):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        # NOTE: the CUDA kernel is bf16-only on Hopper-class GPUs; other cases take the loop.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Per-expert matmul of expert-major rows: x [N, K], w [E, K, M] -> [N, M].

    Rows [offset_e, offset_e + tokens_per_expert[e]) of x are multiplied by w[e].
    impl: "auto" (torch._grouped_mm where the dtype/device allows, else loop), "grouped_mm",
    or "loop" (one matmul per expert: the reference, and the fallback).
    """
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_supported(x, w) else "loop"
    if impl not in ("grouped_mm", "loop"):
        raise ValueError(f"unknown grouped GEMM impl {impl!r}; use auto, grouped_mm or loop")
    if torch.compiler.is_compiling():  # traced: the same kernels as one opaque op (above)
        return grouped_mm_op(x, w, tokens_per_expert, impl)
    if impl == "grouped_mm":
        return torch._grouped_mm(x, w, offs=_offsets(tokens_per_expert))
    return _loop(x, w, tokens_per_expert)


@torch.library.custom_op("moetrain::grouped_mm", mutates_args=())
def grouped_mm_op(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, impl: str
) -> torch.Tensor:
    """x [N, K] expert-major, w [E, K, M] -> [N, M]; impl: "grouped_mm" or "loop"."""
    if impl == "grouped_mm":  # (eager's layouts: the CUDA kernel's alignment rules hold)
        out = torch._grouped_mm(x.contiguous(), w, offs=_offsets(tokens_per_expert))
    else:
        out = _loop(x, w, tokens_per_expert)
    # NOTE: the fake kernel says contiguous; the compiled code around it relies on that.
    return out.contiguous()


@grouped_mm_op.register_fake
def _(x, w, tokens_per_expert, impl):
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("moetrain::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(
    x: torch.Tensor, grad: torch.Tensor, tokens_per_expert: torch.Tensor, impl: str
) -> torch.Tensor:
    """The weight gradient of `grouped_mm_op`: x [N, K], grad [N, M] -> [E, K, M], expert e
    gets x_e^T @ grad_e over its rows (zeros for an expert without tokens)."""
    if impl == "grouped_mm":
        out = torch._grouped_mm(x.contiguous().t(), grad, offs=_offsets(tokens_per_expert))
    else:
        xs = torch.split(x, tokens_per_expert.tolist())
        gs = torch.split(grad, tokens_per_expert.tolist())
        out = torch.stack([xe.t() @ ge for xe, ge in zip(xs, gs, strict=True)])
    return out.contiguous()


@grouped_mm_wgrad.register_fake
def _(x, grad, tokens_per_expert, impl):
    return x.new_empty((tokens_per_expert.shape[0], x.shape[1], grad.shape[1]))


def _setup(ctx, inputs, output) -> None:
    x, w, tokens_per_expert, impl = inputs
    ctx.save_for_backward(x, w, tokens_per_expert)
    ctx.impl = impl


def _backward(ctx, grad):
    x, w, tokens_per_expert = ctx.saved_tensors
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_mm_op(grad, w.transpose(-2, -1), tokens_per_expert, ctx.impl)
    if ctx.needs_input_grad[1]:
        if w.stride(-2) == 1:  # w [E, K, M] a transposed view of [E, M, K] (nn.Linear's)
            # NOTE: the gradient in the weight's own layout, as `_grouped_mm`'s autograd
            # gives it: (grad^T x)^T, not x^T grad, whose transpose accumulating into the
            # [E, M, K] parameter would be copied (a pass over every expert weight, each
            # projection, each step: benchmarks/results/2026-11-27-vs-torchtitan-h200.json).
            dw = grouped_mm_wgrad(grad, x, tokens_per_expert, ctx.impl).transpose(-2, -1)
        else:
            dw = grouped_mm_wgrad(x, grad, tokens_per_expert, ctx.impl)
    return dx, dw, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup)
