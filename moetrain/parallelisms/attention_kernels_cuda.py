"""The ring's block kernels on CUDA (the contract is `attention_kernels`'s: forward ->
(out fp32, lse fp32 [B, Hq, Sq]); backward against the ring's final out and lse).

- `sdpa_flash`: SDPA's FlashAttention-2 op. bf16/fp16, one head dim for q, k and v (<= 256),
  no mask (causal: aligned diagonal blocks).
- `sdpa_efficient`: SDPA's memory-efficient op; any float dtype, v's head dim may differ,
  and a mask as an additive bias (O(Sq * Sk) per block: the trimmed piece, not the chunk).
- `sdpa_cudnn`: SDPA's cuDNN op; bf16/fp16, no mask here.
- `flex`: FlexAttention (moetrain/models/common/flex.py): masks read from their description
  (`Visibility`) inside the kernel, no dense mask; backward recomputes the block.

SDPA's ops take [B, H, S, D] and no GQA: K/V heads are repeated to the query heads for the
call (a block's worth, not the sequence's) and dK/dV summed back over each group. Their
backward takes the ring's final (out, lse) in place of the block's own, which is what
makes each block's gradient its exact share (as the math kernel's `delta`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.models.common.flex import block_mask_of, flex_attend, flex_vjp, visibility_of
from moetrain.models.common.visibility import Visibility, dense_mask

aten = torch.ops.aten


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [B, S, H, D] <-> [B, H, S, D]


def _heads(q, k, v):
    """[B, S, H, D] -> [B, H, S, D] contiguous, K/V repeated to the query heads."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) if group > 1 else t for t in (k, v))
    return tuple(_bhsd(t).contiguous() for t in (q, k, v))


def _fold(dk: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, Hq, S, D] -> [B, S, Hkv, D] fp32: each KV head's gradient summed over its group."""
    b, hq, s, d = dk.shape
    return dk.float().view(b, hkv, hq // hkv, s, d).sum(2).transpose(1, 2)


def _no_mask(name: str, mask) -> None:
    if mask is not None:  # resolve_kernel never picks these kernels for a masked ring
        raise ValueError(f"the {name} block kernel cannot apply a document mask")


# --- SDPA's FlashAttention-2 ------------------------------------------------------------


def flash_forward(q, k, v, scale, causal, mask=None):
    _no_mask("sdpa_flash", mask)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(
        *_heads(q, k, v), 0.0, causal, False, scale=scale
    )
    return _bhsd(out).float(), lse.float()


def flash_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    _no_mask("sdpa_flash", mask)
    qh, kh, vh = _heads(q, k, v)
    dtype, sq, sk = q.dtype, q.shape[1], k.shape[1]
    # NOTE: None for the cumulative sequence lengths is the dense (not varlen) case; with
    # no dropout the RNG state is not read.
    none = torch.empty(0, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        _bhsd(grad_out.to(dtype)).contiguous(),
        qh,
        kh,
        vh,
        _bhsd(out.to(dtype)).contiguous(),
        lse.contiguous(),
        None,
        None,
        sq,
        sk,
        0.0,
        causal,
        none,
        none,
        scale=scale,
    )
    return _bhsd(dq).float(), _fold(dk, k.shape[2]), _fold(dv, k.shape[2])


# --- SDPA's memory-efficient kernel -----------------------------------------------------


def _bias(mask, q, hq: int) -> torch.Tensor | None:
    """[B, Sq, Sk] bool -> [B, Hq, Sq, Sk] additive bias in q's dtype (0 or -inf).
    NOTE: the kernel wants the bias rows 16-element aligned: the storage is padded and the
    view cut back; heads share it (stride 0)."""
    if mask is None:
        return None
    b, sq, sk = mask.shape
    padded = torch.full(
        (b, 1, sq, -(-sk // 16) * 16), float("-inf"), dtype=q.dtype, device=q.device
    )
    padded[..., :sk].masked_fill_(mask[:, None], 0.0)
    return padded[..., :sk].expand(b, hq, sq, sk)


def efficient_forward(q, k, v, scale, causal, mask=None):
    mask = dense_mask(mask)
    qh, kh, vh = _heads(q, k, v)
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(
        qh, kh, vh, _bias(mask, q, q.shape[2]), True, 0.0, causal, scale=scale
    )
    out, lse = _bhsd(out).float(), lse[..., : q.shape[1]].float()  # lse rows may be padded
    if mask is not None:  # a row that sees no key of the block: out 0, lse -inf (no NaN)
        seen = mask.any(-1)  # [B, Sq]
        out = out.masked_fill(~seen[:, :, None, None], 0.0)
        lse = lse.masked_fill(~seen[:, None, :], float("-inf"))
    return out, lse


def efficient_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    mask = dense_mask(mask)
    qh, kh, vh = _heads(q, k, v)
    dtype, bias = q.dtype, _bias(mask, q, q.shape[2])
    # The kernel reads its LSE rows padded to a multiple of 32.
    lse = F.pad(lse, (0, -(-lse.shape[-1] // 32) * 32 - lse.shape[-1])).contiguous()
    none = torch.empty(0, device=q.device)
    # NOTE: dO and O in the forward's own layout, [B, S, H, D] in memory seen as [B, H, S, D]:
    # given [B, H, S, D]-contiguous ones the kernel's dQ/dK come out NaN or wrong (tested on
    # CUDA: tests/test_gpu.py); the layout the forward wrote is the one it reads back.
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(grad_out.to(dtype).contiguous()),
        qh,
        kh,
        vh,
        bias,
        _bhsd(out.to(dtype).contiguous()),
        lse,
        none,
        none,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return _bhsd(dq).float(), _fold(dk, k.shape[2]), _fold(dv, k.shape[2])


# --- SDPA's cuDNN kernel ----------------------------------------------------------------


def cudnn_forward(q, k, v, scale, causal, mask=None):
    _no_mask("sdpa_cudnn", mask)
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        *_heads(q, k, v), None, True, 0.0, causal, False, scale=scale
    )
    b, hq, sq = q.shape[0], q.shape[2], q.shape[1]
    return _bhsd(out).float(), lse.float().reshape(b, hq, sq)  # cuDNN's is [B, H, S, 1]


def cudnn_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    _no_mask("sdpa_cudnn", mask)
    qh, kh, vh = _heads(q, k, v)
    dtype, sq, sk = q.dtype, q.shape[1], k.shape[1]
    none = torch.empty(0, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(grad_out.to(dtype)).contiguous(),
        qh,
        kh,
        vh,
        _bhsd(out.to(dtype)).contiguous(),
        lse.float()[..., None].contiguous(),
        none,
        none,
        None,
        None,
        None,
        sq,
        sk,
        0.0,
        causal,
        scale=scale,
    )
    return _bhsd(dq).float(), _fold(dk, k.shape[2]), _fold(dv, k.shape[2])


# --- FlexAttention ----------------------------------------------------------------------


def _flex_mask(q, k, causal, mask):
    if mask is not None and not isinstance(mask, Visibility):
        raise TypeError("the flex block kernel reads a mask's rule (a Visibility), not its bits")
    return block_mask_of(visibility_of(mask, causal, _bhsd(q), k.shape[1]), q.shape[1], k.shape[1])


def flex_forward(q, k, v, scale, causal, mask=None):
    block_mask = _flex_mask(q, k, causal, mask)
    out, lse = flex_attend(*(_bhsd(t) for t in (q, k, v)), block_mask, scale)
    return _bhsd(out).float(), lse


def flex_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    """The block's share of the ring's gradient through its own (out_b, lse_b): the ring's
    out is sum_b exp(lse_b - lse) out_b with lse = logsumexp_b lse_b, so with w_b =
    exp(lse_b - lse): d out_b = w_b dO and d lse_b = w_b (rowsum(dO * out_b) - rowsum(dO * out))."""
    block_mask = _flex_mask(q, k, causal, mask)
    d_out = _bhsd(grad_out.float())  # [B, Hq, Sq, Dv]
    delta = (d_out * _bhsd(out.float())).sum(-1)  # [B, Hq, Sq]
    final = lse.masked_fill(lse == float("-inf"), 0.0)

    def grads_of(out_b, lse_b):
        w = torch.exp(lse_b - final)  # 0 where the block showed the row no key
        return w[..., None] * d_out, w * ((d_out * out_b.float()).sum(-1) - delta)

    dq, dk, dv = flex_vjp(*(_bhsd(t) for t in (q, k, v)), block_mask, scale, grads_of)
    return tuple(_bhsd(t).float() for t in (dq, dk, dv))
