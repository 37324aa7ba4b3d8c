"""Context parallelism: the sequence split over `cp` ranks, attention run as a ring.

Each rank keeps its queries; key/value blocks travel rank -> rank + 1 with
`batch_isend_irecv`, the next transfer posted before the current block is computed.
Blocks merge by online softmax in fp32 (out, log-sum-exp). Backward recomputes each block
from the saved LSE, re-circulates K/V, and sends the fp32 dK/dV partial sums around the
ring so that each arrives, complete, at its owner. Memory per rank stays O(seq / cp).

Causal balance: with the zigzag layout (the sequence cut into 2*cp chunks, rank r holding
chunks r and 2*cp-1-r) every ring step costs every rank the same work. Only the KV heads
travel (GQA): nothing is repeated before the ring.

Sliding windows (`window`) are a mask rule like document masks (`block_mask`): chunk pairs
wholly outside the window get no kernel call. Sinks (`sinks` [Hq]) enter the online-softmax
merge once per row, after every key block, as a block of output 0 and log-sum-exp = the sink;
no message grows, and backward adds the sink's gradient, -exp(sink - lse) * rowsum(dO * O).

Document masks (`document_ids`): each K/V message also carries its block's document ids
(their bits appended to the same buffer: one message per hop, exact). Per ring step the
rank computes only the chunk pairs in which some query sees some key (`document_blocks`,
trimmed to the rows and columns that take part) with a masked block kernel; the rest get
no kernel call. Forward records those pieces on the ring, and backward computes exactly
the same ones.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moetrain.parallelisms.attention_kernels import resolve_kernel
from moetrain.parallelisms.ring_messages import (
    RingStats,
    merge,
    pack,
    pass_to_next,
    unpack,
    unpack_ids,
    wait_all,
)
from moetrain.parallelisms.ring_steps import Ring, mask_ids, sink_lse, step_blocks
from moetrain.parallelisms.trace import named_range


def _ring_forward(q, k, v, ids, sinks, ring: Ring) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: document ids [B, S] or None; sinks [Hq] or None -> out [B, S, Hq, Dv] fp32,
    lse [B, Hq, S] fp32 (the sinks included: backward needs the final normaliser)."""
    group, kernel, stats = ring.group, ring.kernel, ring.stats
    cp, rank, seq = group.size(), group.rank(), q.shape[1]
    out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=torch.float32)  # [B, S, Hq, Dv]
    lse = q.new_full((q.shape[0], q.shape[2], seq), float("-inf"), dtype=torch.float32)
    kv = pack(k, v, ids)
    for step in range(cp):
        src = (rank - step) % cp
        if step + 1 < cp:  # overlap: the next block is on its way while this one computes
            next_kv, works = pass_to_next(kv, group, 0, stats)
        k_blk, v_blk = unpack(kv, k.shape, v.shape)
        q_ids, k_ids = mask_ids(ids, unpack_ids(kv, k.shape, v.shape, ids), ring, q)
        with named_range(f"cp.ring.step{step}"):
            for rows, cols, blk_causal, mask in step_blocks(ring, step, src, seq, q_ids, k_ids):
                blk_out, blk_lse = kernel.forward(
                    q[:, rows], k_blk[:, cols], v_blk[:, cols], ring.scale, blk_causal, mask
                )
                stats.kernel_calls += 1
                stats.pairs += q.shape[0] * (rows.stop - rows.start) * (cols.stop - cols.start)
                merge(out, lse, blk_out, blk_lse, rows)
        if step + 1 < cp:
            wait_all(works)
            kv = next_kv
    if sinks is not None:  # once per row, after every key block
        merge(out, lse, torch.zeros_like(out), sink_lse(sinks, q), slice(None))
    return out, lse


def _ring_backward(grad_out, q, k, v, out, lse, ids, sinks, ring: Ring):
    group, kernel, stats = ring.group, ring.kernel, ring.stats
    cp, rank, seq = group.size(), group.rank(), q.shape[1]
    grad_out = grad_out.float().contiguous()
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = pack(k, v, ids)  # the ids travel again: backward rebuilds each piece's mask
    partial_in, dkv_works = None, []  # partial dK/dV of the current block, from before
    for step in range(cp):
        src = (rank - step) % cp
        if step + 1 < cp:
            next_kv, kv_works = pass_to_next(kv, group, 0, stats)
        k_blk, v_blk = unpack(kv, k.shape, v.shape)
        q_ids, k_ids = mask_ids(ids, unpack_ids(kv, k.shape, v.shape, ids), ring, q)
        dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=kv.device)
        dk_blk, dv_blk = unpack(dkv, k.shape, v.shape)
        with named_range(f"cp.ring.step{step}.backward"):
            for rows, cols, blk_causal, mask in step_blocks(ring, step, src, seq, q_ids, k_ids):
                dq_b, dk_b, dv_b = kernel.backward(
                    grad_out[:, rows],
                    q[:, rows],
                    k_blk[:, cols],
                    v_blk[:, cols],
                    out[:, rows],
                    lse[:, :, rows],
                    ring.scale,
                    blk_causal,
                    mask,
                )
                stats.backward_kernel_calls += 1
                dq[:, rows] += dq_b
                dk_blk[:, cols] += dk_b
                dv_blk[:, cols] += dv_b
        if partial_in is not None:
            wait_all(dkv_works)
            dkv += partial_in
        if cp == 1:
            partial_in, dkv_works = dkv, []
            continue
        # Hand this block's dK/dV sum on; after cp hops each block's sum is home.
        partial_in, dkv_works = pass_to_next(dkv, group, 1, stats)
        if step + 1 < cp:
            wait_all(kv_works)
            kv = next_kv
    wait_all(dkv_works)
    dk, dv = unpack(partial_in, k.shape, v.shape)
    dsinks = None
    if sinks is not None:
        # d out / d sink = -p_sink * out per row, p_sink = exp(sink - lse): summed over this
        # rank's rows (FSDP sums the ranks' shares like any gradient).
        delta = (grad_out * out).sum(-1).transpose(1, 2)  # [B, Hq, s]
        dsinks = -(torch.exp(sink_lse(sinks, q) - lse) * delta).sum((0, 2)).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


# Live rings by handle: the ring op takes plain values, not Python objects.
_RINGS: weakref.WeakValueDictionary[int, Ring] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("moetrain::ring_attention", mutates_args=())
def _ring_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    ring: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward as one op (one opaque call for dispatch modes and compile)."""
    return _ring_forward(q, k, v, ids, sinks, _RINGS[ring])


@_ring_op.register_fake
def _(q, k, v, ids, sinks, ring):
    out = q.new_empty((*q.shape[:3], v.shape[3]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, ids, sinks, handle = inputs
    ctx.save_for_backward(q, k, v, *output, ids, sinks)
    ctx.ring = _RINGS[handle]
    ctx.mark_non_differentiable(output[1])  # the LSE


def _ring_op_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, ids, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _ring_backward(grad_out, q, k, v, out, lse, ids, sinks, ctx.ring)
    return dq, dk, dv, None, dsinks, None


_ring_op.register_autograd(_ring_op_backward, setup_context=_ring_setup)


def _run_ring(q, k, v, ids, sinks, ring: Ring) -> tuple[torch.Tensor, torch.Tensor]:
    """Local q, k, v (and document ids, sinks or None) -> (out in q's dtype, lse fp32). The
    fp32 out stays the op's output: backward recomputes each block against it."""
    handle = next(_handles)
    _RINGS[handle] = ring  # held by the caller for the call, then by the autograd graph
    out, lse = _ring_op(q, k, v, ids, sinks, handle)
    return out.to(q.dtype), lse


# --- DTensor-aware entry point and the module a plan installs ---------------------------


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    zigzag: bool = True,
    kernel: str = "auto",
    group: dist.ProcessGroup | None = None,
    cp_dim: str = "cp",
    stats: RingStats | None = None,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence split across ranks: q [B, s, Hq, D], k [B, s, Hkv, D],
    v [B, s, Hkv, Dv] (s = S / cp) -> out [B, s, Hq, Dv], lse [B, Hq, s] (fp32).

    DTensor inputs must be `Shard(1)` on the mesh dim named `cp_dim` (of any mesh); the
    outputs are DTensors with the same placements (`Shard(2)` for the LSE's sequence dim).
    Plain tensors need `group`, the ring's process group.

    document_ids [B, s] (this rank's part, split like q; plain or DTensor): a query sees
    only the keys of its own document (causally if `causal`); None: no document mask.
    window: a query sees only keys fewer than `window` positions away (sliding window).
    sinks [Hq]: each head's sink logit, in every row's softmax denominator (the lse too).
    table [cp, k]: the chunks each rank holds under a balanced layout (the data path's
    `cp_schedule.balanced_table` of this micro-batch); masks only.
    """
    masked = document_ids is not None or window is not None
    if table is not None and not masked:
        raise ValueError(
            "a balanced cp layout needs document masks (or a window): without "
            "them zigzag is already balanced"
        )
    if isinstance(sinks, DTensor):
        sinks = sinks.full_tensor()
    block_kernel = resolve_kernel(kernel, q.device, q.shape[-1], v.shape[-1], masked, q.dtype)
    stats = stats or RingStats()
    if isinstance(document_ids, DTensor):
        document_ids = document_ids.to_local()
    local_q = q.to_local() if isinstance(q, DTensor) else q
    if document_ids is not None and document_ids.shape != local_q.shape[:2]:
        raise ValueError(
            f"document_ids must be this rank's [B, s] {tuple(local_q.shape[:2])}, got "
            f"{tuple(document_ids.shape)}"
        )
    if not isinstance(q, DTensor):
        if group is None:
            raise ValueError(
                "ring_attention on plain tensors needs group=, the ring's process group"
            )
        ring = Ring(group, scale, causal, zigzag, block_kernel, stats, window, table)
        return _run_ring(q, k, v, document_ids, sinks, ring)
    mesh, placements = q.device_mesh, q.placements
    cp_index = mesh.mesh_dim_names.index(cp_dim)
    for t in (q, k, v):
        if t.placements != placements or t.placements[cp_index] != Shard(1):
            raise ValueError(
                f"ring_attention needs q, k, v sharded Shard(1) (sequence) on mesh dim "
                f"{cp_dim!r}, got {[t.placements for t in (q, k, v)]}"
            )
    ring = Ring(mesh.get_group(cp_dim), scale, causal, zigzag, block_kernel, stats, window, table)
    out, lse = _run_ring(q.to_local(), k.to_local(), v.to_local(), document_ids, sinks, ring)
    lse_placements = [Shard(2) if p == Shard(1) else p for p in placements]
    return (
        DTensor.from_local(out, mesh, placements, run_check=False),
        DTensor.from_local(lse, mesh, lse_placements, run_check=False),
    )


class ContextParallelAttention(nn.Module):
    """Drop-in for `moetrain.models.common.attention.AttentionCore` under context parallelism.

    The model hands it its local [B, s, H, D] tensors as usual (this rank's part of each
    sequence, s = S / cp); it runs the ring over the `cp` process group and hands back the
    local output. The model never learns that the sequence is split.
    """

    def __init__(
        self,
        scale: float,
        causal: bool,
        group: dist.ProcessGroup,
        zigzag: bool,
        kernel: str,
        window: int | None = None,
    ):
        super().__init__()
        self.scale, self.causal, self.zigzag, self.kernel = scale, causal, zigzag, kernel
        self.group, self.window = group, window
        self.stats = RingStats()
        # parallel.cp_layout=balanced: this micro-batch's chunk table, set by the trainer
        # before each forward (`use_cp_table`); None: the zigzag or contiguous formula
        self.table: torch.Tensor | None = None

    # NOTE: under train.compile the ring runs eagerly (a graph break around the attention
    # core): each call registers its Ring under a fresh handle, which traced code would turn
    # into a symbolic int; the ring is host-driven transfers, nothing for a compiler to fuse.
    @torch.compiler.disable
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `AttentionCore.forward`; document_ids [B, s] is this rank's part."""
        out, _ = ring_attention(
            q,
            k,
            v,
            scale=self.scale,
            causal=self.causal,
            zigzag=self.zigzag,
            kernel=self.kernel,
            group=self.group,
            stats=self.stats,
            document_ids=document_ids,
            window=self.window,
            sinks=sinks,
            table=self.table,
        )
        return out

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return (
            f"scale={self.scale:.4g}, causal={self.causal}{window}, zigzag={self.zigzag}, "
            f"kernel={self.kernel}"
        )


def apply_context_parallel(
    model: nn.Module,
    cores: list[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    zigzag: bool,
    kernel: str,
) -> list[ContextParallelAttention]:
    """Replace each attention core (from the plan) by its ring over `mesh`'s `cp` dim;
    returns them."""
    group = mesh.get_group("cp")
    installed = []
    for fqn, core in cores:
        parent_name, _, child = fqn.rpartition(".")
        ring = ContextParallelAttention(core.scale, core.causal, group, zigzag, kernel, core.window)
        setattr(model.get_submodule(parent_name), child, ring)
        installed.append(ring)
    return installed


def use_cp_table(rings: list[ContextParallelAttention], table: torch.Tensor | None) -> None:
    """Hand a micro-batch's balanced layout (or None) to the model's rings (the list
    `apply_context_parallel` returned) before its forward: the data path split that
    micro-batch by the same table."""
    for ring in rings:
        ring.table = table
