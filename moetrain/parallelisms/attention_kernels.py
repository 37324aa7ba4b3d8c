"""Block attention kernels that return the log-sum-exp, for the ring (context parallelism).

A kernel computes one (query block x key block) piece: forward -> (out, lse), and a
backward that takes the *final* out and lse of the whole ring (so each block's gradient is
its exact share). Layouts: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv];
out [B, Sq, Hq, Dv] fp32, lse [B, Hq, Sq] fp32. A causal block is a diagonal one (Sq == Sk,
aligned). GQA: Hkv divides Hq; K/V are never repeated.

Document masks: `mask` is a `Visibility` (the rule for the block, which FlexAttention
reads as it is) or a [B, Sq, Sk] bool tensor (True = the query sees the key), on top of
`causal`. The math, memory-efficient and flex kernels take one. A query row that sees no
key of the block gets out 0 and lse -inf (not NaN), so the ring's online softmax can fold
it in as "nothing".

The CUDA kernels (SDPA's flash, memory-efficient and cuDNN ops, FlexAttention) are in
`attention_kernels_cuda`, flash-attn-4's in `attention_kernels_flash`; `resolve_kernel`
picks one by device, dtype, head dims and mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetrain.models.common.visibility import dense_mask
from moetrain.parallelisms import attention_kernels_cuda as cuda
from moetrain.parallelisms.attention_kernels_flash import flash_attn_backward, flash_attn_forward
from moetrain.parallelisms.flash_attn_support import (
    FlashAttnUse,
    flash_attn_problems,
    host_of,
    refusal,
)


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, S, Hq, D] -> [B, Hkv, G, S, D] fp32 (query heads grouped by their KV head)."""
    b, s, hq, d = q.shape
    return q.float().view(b, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)


def _kv(t: torch.Tensor) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv, 1, S, D] fp32 (broadcast over the query group)."""
    return t.float().permute(0, 2, 1, 3)[:, :, None]


def _scores(q, k, scale, causal, mask=None) -> torch.Tensor:
    s = _grouped(q, k.shape[2]) @ _kv(k).transpose(-1, -2) * scale  # [B, Hkv, G, Sq, Sk]
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    if mask is not None:  # [B, Sq, Sk] -> broadcast over [Hkv, G]
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The LSE with -inf (a row that sees no key) replaced by 0: exp(-inf - 0) = 0 gives that
    row zero weights, where exp(-inf - -inf) would give NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, S, D] -> [B, S, Hkv * G, D]."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d)


def math_forward(q, k, v, scale, causal, mask=None):
    s = _scores(q, k, scale, causal, dense_mask(mask))
    lse = s.logsumexp(-1)  # [B, Hkv, G, Sq]; -inf where a row sees no key
    out = torch.exp(s - _finite(lse)[..., None]) @ _kv(v)
    return _ungroup(out), lse.flatten(1, 2)


def math_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    hkv = k.shape[2]
    lse = _finite(lse.view(*lse.shape[:1], hkv, -1, lse.shape[-1]))  # [B, Hkv, G, Sq]
    p = torch.exp(_scores(q, k, scale, causal, dense_mask(mask)) - lse[..., None])
    do = _grouped(grad_out, hkv)  # [B, Hkv, G, Sq, Dv]
    dv = (p.transpose(-1, -2) @ do).sum(2)  # [B, Hkv, Sk, Dv]
    dp = do @ _kv(v).transpose(-1, -2)
    delta = (do * _grouped(out, hkv)).sum(-1, keepdim=True)  # rowsum(dO * O)
    ds = p * (dp - delta) * scale
    dq = ds @ _kv(k)
    dk = (ds.transpose(-1, -2) @ _grouped(q, hkv)).sum(2)
    return _ungroup(dq), dk.transpose(1, 2), dv.transpose(1, 2)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [B, S, H, D] <-> [B, H, S, D]


def _no_mask(mask) -> None:
    if mask is not None:  # resolve_kernel never picks this kernel for a masked ring
        raise ValueError("the cpu_flash block kernel cannot apply a document mask")


def cpu_flash_forward(q, k, v, scale, causal, mask=None):
    _no_mask(mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
    )
    return _bhsd(out).float(), lse.float()


def cpu_flash_backward(grad_out, q, k, v, out, lse, scale, causal, mask=None):
    _no_mask(mask)
    dtype = q.dtype
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(grad_out.to(dtype)),
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        _bhsd(out.to(dtype)),
        lse.contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return _bhsd(dq).float(), _bhsd(dk).float(), _bhsd(dv).float()


@dataclass(frozen=True)
class BlockKernel:
    """forward(q, k, v, scale, causal, mask=None) -> (out, lse); backward(grad_out, q, k, v,
    out, lse, scale, causal, mask=None) -> (dq, dk, dv), all fp32.

    `whole_blocks`: the kernel reads a mask's rule and skips the tiles nobody sees itself,
    so the ring gives it one whole block per step instead of the trimmed pieces. NOTE: flex
    wants that: its compiled kernel has fixed shapes, and the pieces' lengths vary."""

    name: str
    forward: Callable
    backward: Callable
    whole_blocks: bool = False


KERNELS = {
    "math": BlockKernel("math", math_forward, math_backward),
    "cpu_flash": BlockKernel("cpu_flash", cpu_flash_forward, cpu_flash_backward),
    "sdpa_flash": BlockKernel("sdpa_flash", cuda.flash_forward, cuda.flash_backward),
    "sdpa_efficient": BlockKernel(
        "sdpa_efficient", cuda.efficient_forward, cuda.efficient_backward
    ),
    "sdpa_cudnn": BlockKernel("sdpa_cudnn", cuda.cudnn_forward, cuda.cudnn_backward),
    "flex": BlockKernel("flex", cuda.flex_forward, cuda.flex_backward, whole_blocks=True),
    "flash_attn": BlockKernel("flash_attn", flash_attn_forward, flash_attn_backward),
}
CUDA_ONLY = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex")
_HALF = (torch.bfloat16, torch.float16)


def _auto(device: torch.device, dtype, head_dim: int, v_head_dim: int, masked: bool) -> str:
    """CPU: the CPU flash op where it applies, else math. CUDA: flex for masks (no dense
    mask), SDPA's flash op for half precision with one head dim, else the memory-efficient op
    (fp32, or v's head dim apart).

    NOTE: never `flash_attn`: auto picks a kernel only once a GPU benchmark
    (benchmarks/attention_kernels.py, committed under benchmarks/results/) shows it faster
    than the one picked today for the same case; flash-attn-4 has not been timed yet."""
    if device.type == "cpu":
        return "cpu_flash" if head_dim == v_head_dim and not masked else "math"
    if device.type != "cuda":
        return "math"
    if masked:
        return "flex"
    if dtype in _HALF and head_dim == v_head_dim and head_dim <= 256:
        return "sdpa_flash"
    return "sdpa_efficient"


def resolve_kernel(
    name: str,
    device: torch.device,
    head_dim: int,
    v_head_dim: int,
    masked: bool = False,
    dtype: torch.dtype | None = None,
) -> BlockKernel:
    """`parallel.cp_kernel` -> the block kernel; auto picks by device, dtype, head dims and
    mask (`masked`: document masks or a window). A kernel that cannot run the ring is
    refused, naming why."""
    if name == "auto":
        name = _auto(device, dtype, head_dim, v_head_dim, masked)
    if name not in KERNELS:
        raise ValueError(
            f"unknown attention kernel {name!r}; choose one of auto, {', '.join(KERNELS)}"
        )
    if name == "cpu_flash" and (device.type != "cpu" or head_dim != v_head_dim):
        raise ValueError(
            "parallel.cp_kernel=cpu_flash needs CPU tensors and equal q/k and v head dims "
            f"(got {device.type}, {head_dim} vs {v_head_dim}); use auto or math"
        )
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"parallel.cp_kernel={name} runs on CUDA only; use auto or math")
    if name in ("cpu_flash", "sdpa_flash", "sdpa_cudnn") and masked:
        raise ValueError(
            f"parallel.cp_kernel={name} cannot apply document masks or windows; use "
            "parallel.cp_kernel=auto (flex on CUDA, math on CPU), flex, sdpa_efficient or math"
        )
    if name == "flash_attn":
        # dtype None: not known here; the kernel's call checks it
        use = FlashAttnUse(dtype or torch.bfloat16, head_dim, v_head_dim, ring_masks=masked)
        problems = flash_attn_problems(host_of(device), use)
        if problems:
            raise ValueError(refusal(problems))
    if name in ("sdpa_flash", "sdpa_cudnn") and (
        dtype not in _HALF or head_dim != v_head_dim or head_dim > 256
    ):
        raise ValueError(
            f"parallel.cp_kernel={name} needs bf16/fp16 and one head dim <= 256 for q, k and v "
            f"(got {dtype}, {head_dim} and {v_head_dim}); use auto, sdpa_efficient or flex"
        )
    return KERNELS[name]
