"""FlexAttention for masked attention on CUDA: document masks and sliding windows without a
dense [Sq, Sk] mask (a `BlockMask` keeps one bit per 128 x 128 tile and reads the rule,
`Visibility`, inside the kernel), and sinks folded in through the log-sum-exp.

Two users:
- `AttentionCore` on CUDA (`flex_attention_core`): one op, `moetrain::flex_attention`,
  whose backward recomputes the forward and differentiates it. NOTE: why an op and not a
  plain call: dispatch modes (the dry-run planner's tracers) see one opaque call, which
  the flex higher-order op would refuse.
- the ring's `flex` block kernel (moetrain/parallelisms/attention_kernels_cuda.py): forward and a
  backward against the ring's final (out, lse), `flex_vjp`.

Eager flex_attention is a dense reference implementation; on CUDA it is compiled once per
process (inductor's fused kernel: memory O(S)). On CPU the forward runs eagerly (tests) and
there is no backward (FlexAttention has none on CPU).

Layouts here are SDPA's: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv];
out [B, Hq, Sq, Dv] in q's dtype, lse [B, Hq, Sq] fp32, natural log, -inf on a row that
sees no key (its out is 0).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.nn.attention import flex_attention as flex_module

from moetrain.models.common.visibility import Visibility

_AUX = "return_aux" in inspect.signature(flex_module.flex_attention).parameters
# The dispatcher's thread-local key sets outside any op (read once, at import): an op's
# implementation runs with autograd and functorch keys excluded (eager: autograd; under
# train.compile: vmap too), and the flex path needs both (the backward differentiates a
# recomputed forward; BlockMask builds its tables with vmap). NOTE: restored only inside
# this module's two ops, for their own calls.
_TOP_LEVEL_KEYS = (
    torch._C._dispatch_tls_local_include_set(),
    torch._C._dispatch_tls_local_exclude_set(),
)


@functools.cache
def _compiled_flex() -> Callable:
    # NOTE: static shapes: with symbolic lengths inductor's flex template found no kernel
    # (benchmarks/results/2026-11-25-gpu-suite-h100.json). The callers keep shapes fixed: the core its sequence, the ring
    # one whole block per step.
    return torch.compile(flex_module.flex_attention, dynamic=False)


# NOTE: past dynamo's recompile limit (8 by default) a compiled function silently runs
# eagerly, and eager flex is dense: O(S^2) memory for a long call (measured on a GPU:
# benchmarks/results/2026-11-25-gpu-suite-h100.json). Flex is
# recompiled per head dim, scale, grad mode and mask rule; its calls get a higher limit,
# and hitting it fails loudly where this torch can say so.
_LIMITS = {"recompile_limit": 64}
if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
    _LIMITS["fail_on_recompile_limit_hit"] = True


TILE = 128  # FlexAttention's default sparse block: one bit per TILE x TILE of (q, k)
_NO_WINDOW = 1 << 62


def _rule(q_ids, k_ids, q_pos, k_pos, causal, window):
    """The visibility rule as a mask_mod over tensors only (`causal` a 0-d bool, `window` a
    0-d int64): one code object for every block, so compiled flex never recompiles for
    another mask (a new rule per call would, and past dynamo's recompile limit it falls
    back to eager flex, which is dense: O(Sq * Sk) memory)."""

    def visible(b, h, qi, ki):
        distance = q_pos[qi] - k_pos[ki]
        return (
            (q_ids[b, qi] == k_ids[b, ki]) & ((distance >= 0) | ~causal) & (distance.abs() < window)
        )

    return visible


def _tile_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., S] -> its min and max per TILE of the last dim, [..., ceil(S / TILE)] each."""
    pad = -x.shape[-1] % TILE
    x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1) if pad else x
    tiles = x.unflatten(-1, (-1, TILE))
    return tiles.amin(-1), tiles.amax(-1)


def _sparse_tiles(vis: Visibility, sq: int, sk: int):
    """Which (q tile, k tile) pairs some query sees a key in ("any") and in which every query
    sees every key ("all"), [B, 1, nq, nk] bool, bounded from each tile's range of document
    ids and positions (safe either way: a tile counted in "any" without need only costs a
    masked tile, and "all" is claimed only where the ranges prove it)."""
    qid_lo, qid_hi = _tile_range(vis.q_ids)  # [B, nq]
    kid_lo, kid_hi = _tile_range(vis.k_ids)  # [B, nk]
    qp_lo, qp_hi = _tile_range(vis.q_pos)  # [nq]
    kp_lo, kp_hi = _tile_range(vis.k_pos)  # [nk]
    d_lo = qp_lo[:, None] - kp_hi[None, :]  # [nq, nk]: the distances a tile pair spans
    d_hi = qp_hi[:, None] - kp_lo[None, :]
    window = vis.window if vis.window is not None else _NO_WINDOW
    near_any = (d_lo < window) & (d_hi > -window)
    near_all = (d_hi < window) & (d_lo > -window)
    if vis.causal:
        near_any, near_all = near_any & (d_hi >= 0), near_all & (d_lo >= 0)
    docs_any = (qid_lo[:, :, None] <= kid_hi[:, None, :]) & (
        kid_lo[:, None, :] <= qid_hi[:, :, None]
    )
    one_doc = (qid_lo == qid_hi)[:, :, None] & (kid_lo == kid_hi)[:, None, :]
    docs_all = one_doc & (qid_lo[:, :, None] == kid_lo[:, None, :])
    # A ragged last tile holds padding: never "all" (flex masks the padding inside it).
    whole_q = torch.arange(qid_lo.shape[1], device=d_lo.device) < sq // TILE
    whole_k = torch.arange(kid_lo.shape[1], device=d_lo.device) < sk // TILE
    whole = whole_q[:, None] & whole_k[None, :]
    tiles_any = docs_any & near_any
    tiles_all = docs_all & near_all & whole
    return tiles_any[:, None], tiles_all[:, None]


def _listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, nq, nk] bool -> (count per q tile int32, the k tiles' indices first) int32."""
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return tiles.sum(-1).to(torch.int32), order.to(torch.int32)


def visibility_of(mask: Visibility | None, causal: bool, q: torch.Tensor, sk: int) -> Visibility:
    """A block's rule as a `Visibility` (q [B, Hq, Sq, D]): the given one, or one document
    (causal over an aligned square block, or everything)."""
    if mask is not None:
        return mask
    ids = torch.zeros(q.shape[0], max(q.shape[2], sk), dtype=torch.int64, device=q.device)
    pos = torch.arange(max(q.shape[2], sk), device=q.device)
    return Visibility(ids[:, : q.shape[2]], ids[:, :sk], pos[: q.shape[2]], pos[:sk], causal)


def block_mask_of(vis: Visibility, sq: int, sk: int) -> flex_module.BlockMask:
    """The `BlockMask` of a block, from its rule's tile ranges: O((Sq / TILE) * (Sk / TILE))
    memory and no compilation (create_block_mask evaluates the rule at every (q, k))."""
    tiles_any, tiles_all = _sparse_tiles(vis, sq, sk)
    partial = tiles_any & ~tiles_all
    causal = torch.tensor(vis.causal, device=vis.q_ids.device)
    window = torch.tensor(
        vis.window if vis.window is not None else _NO_WINDOW, device=vis.q_ids.device
    )
    return flex_module.BlockMask.from_kv_blocks(
        *_listed(partial),
        *_listed(tiles_all),
        BLOCK_SIZE=TILE,
        mask_mod=_rule(vis.q_ids, vis.k_ids, vis.q_pos, vis.k_pos, causal, window),
        seq_lengths=(sq, sk),
    )


def flex_attend(q, k, v, block_mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse fp32) of one flex call."""
    fn = _compiled_flex() if q.is_cuda else flex_module.flex_attention
    gqa = k.shape[1] != q.shape[1]
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with torch._dynamo.config.patch(**_LIMITS):
        if _AUX:
            out, aux = fn(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kwargs)
            return out, aux.lse.float()
        out, lse = fn(q, k, v, return_lse=True, **kwargs)
        return out, lse.float()


def flex_vjp(q, k, v, block_mask, scale, grads_of: Callable):
    """Recompute one flex call with autograd and pull back the gradients that
    `grads_of(out, lse)` returns for its (out, lse) -> (dq, dk, dv)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flex_attend(*leaves, block_mask, scale)
        grad_out, grad_lse = grads_of(out.detach(), lse.detach())
        return torch.autograd.grad((out, lse), leaves, (grad_out.to(out.dtype), grad_lse))


def _core_block_mask(q, ids, causal, window):
    seq = q.shape[2]
    if ids is None and window is None:
        return block_mask_of(visibility_of(None, causal, q, seq), seq, seq)
    if ids is None:
        ids = torch.zeros(q.shape[0], seq, dtype=torch.int64, device=q.device)
    pos = torch.arange(seq, device=q.device)
    return block_mask_of(Visibility(ids, ids, pos, pos, causal, window), seq, seq)


# NOTE: two ops, forward and backward, both opaque to tracers: under train.compile the
# autograd formula of an op is traced (AOT), and compiled flex cannot be traced again; the
# backward op is called, not traced into.
@torch.library.custom_op("moetrain::flex_attention", mutates_args=())
def _flex_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ids: torch.Tensor | None,
    causal: bool,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch._C._ForceDispatchKeyGuard(*_TOP_LEVEL_KEYS):
        out, lse = flex_attend(q, k, v, _core_block_mask(q, ids, causal, window), scale)
    return out.contiguous(), lse.contiguous()  # the layouts `register_fake` states


@_flex_op.register_fake
def _(q, k, v, ids, causal, window, scale):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("moetrain::flex_attention_backward", mutates_args=())
def _flex_backward_op(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ids: torch.Tensor | None,
    causal: bool,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute the forward with autograd and pull (grad_out, grad_lse) back to q, k, v."""
    with torch._C._ForceDispatchKeyGuard(*_TOP_LEVEL_KEYS):
        block_mask = _core_block_mask(q, ids, causal, window)
        grads = flex_vjp(q, k, v, block_mask, scale, lambda out, lse: (grad_out, grad_lse))
    # In the inputs' layouts, which `register_fake` states (empty_like keeps strides).
    return tuple(torch.empty_like(t).copy_(g) for t, g in zip((q, k, v), grads))


@_flex_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, ids, causal, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, ids, causal, window, scale = inputs
    ctx.save_for_backward(q, k, v, ids)
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, ids = ctx.saved_tensors
    if grad_out is None:
        grad_out = q.new_zeros((*q.shape[:3], v.shape[3]))
    if grad_lse is None:
        grad_lse = q.new_zeros(q.shape[:3], dtype=torch.float32)
    dq, dk, dv = _flex_backward_op(
        grad_out.contiguous(),
        grad_lse.contiguous(),
        q,
        k,
        v,
        ids,
        ctx.causal,
        ctx.window,
        ctx.scale,
    )
    return dq, dk, dv, None, None, None, None


_flex_op.register_autograd(_backward, setup_context=_setup)


def flex_attention_core(q, k, v, document_ids, causal, window, scale, sinks=None):
    """`AttentionCore`'s masked attention on CUDA: q [B, Hq, S, D], k/v [B, Hkv, S, D*],
    document_ids [B, S] or None, sinks [Hq] or None -> out [B, Hq, S, Dv] in q's dtype.

    Sinks join each row's softmax denominator: with the row's lse and the sink s,
    lse' = logaddexp(lse, s) and out' = out * exp(lse - lse') (a key of value 0)."""
    out, lse = _flex_op(q, k, v, document_ids, causal, window, scale)
    if sinks is None:
        return out
    with_sink = torch.logaddexp(lse, sinks.float()[None, :, None])  # [B, Hq, S]
    return (out.float() * torch.exp(lse - with_sink)[..., None]).to(out.dtype)
