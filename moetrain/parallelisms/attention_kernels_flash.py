"""The ring's `flash_attn` block kernel: flash-attn-4 (moetrain/parallelisms/
flash_attn_support.py), under the contract of `attention_kernels` (forward -> (out fp32,
lse fp32 [B, Hq, Sq]); backward against the ring's final out and lse).

Its layouts are the ring's own ([B, S, H, D]), and it takes GQA natively: K/V are never
repeated and dK/dV come back with the KV heads. A causal block is an aligned diagonal one.
No mask: `resolve_kernel` refuses a masked ring for it (a window's band in an off-diagonal
block is offset by the blocks' positions, which its `window_size` cannot say).

The backward is the package's private `_flash_attn_bwd`: its preprocess takes rowsum(dO * O)
from the `out` it is given and its P from the `lse`, so given the ring's final ones each
block's gradient is its exact share (as SDPA's flash backward in `attention_kernels_cuda`).
"""

from __future__ import annotations

import torch

from moetrain.parallelisms.flash_attn_support import check_inputs, interface


def _no_mask(mask) -> None:
    if mask is not None:  # resolve_kernel never picks this kernel for a masked ring
        raise ValueError("the flash_attn block kernel cannot apply a document mask")


def flash_attn_forward(q, k, v, scale, causal, mask=None):
    _no_mask(mask)
    check_inputs(q, k, v)
    # The ring differentiates its blocks itself (the backward below): no autograd graph.
    with torch.no_grad():
        out, lse = interface().flash_attn_func(
            q, k, v, softmax_scale=scale, causal=causal, return_lse=True
        )
    return out.float(), lse.float()


def flash_attn_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    _no_mask(mask)
    dtype = q.dtype
    dq, dk, dv = interface()._flash_attn_bwd(
        q,
        k,
        v,
        out.to(dtype),
        grad_out.to(dtype),
        lse.contiguous(),
        softmax_scale=scale,
        causal=causal,
    )
    return dq.float(), dk.float(), dv.float()
