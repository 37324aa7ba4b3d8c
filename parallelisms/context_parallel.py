"""Context parallelism: the sequence split over `cp` ranks, attention run as a ring.

Each rank keeps its queries; key/value blocks travel rank -> rank + 1 with
`batch_isend_irecv`, the next transfer posted before the current block is computed.
Blocks merge by online softmax in fp32 (out, log-sum-exp). Backward recomputes each block
from the saved LSE, re-circulates K/V, and sends the fp32 dK/dV partial sums around the
ring so that each arrives, complete, at its owner. Memory per rank stays O(seq / cp).

Causal balance: with the zigzag layout (the sequence cut into 2*cp chunks, rank r holding
chunks r and 2*cp-1-r) every ring step costs every rank the same work. Only the KV heads
travel (GQA): nothing is repeated before the ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallelisms.attention_kernels import BlockKernel, resolve_kernel
from parallelisms.cp_schedule import ring_blocks

# --- ring communication ----------------------------------------------------------------


class RingStats:
    """Point-to-point operations posted (for tests and logs)."""

    def __init__(self) -> None:
        self.p2p_ops = 0


def _pass_to_next(buf: torch.Tensor, group, tag: int, stats: RingStats):
    """Post: send `buf` to the next rank, receive the previous rank's into a new buffer."""
    cp, rank = group.size(), group.rank()
    recv = torch.empty_like(buf)
    ops = [
        dist.P2POp(dist.isend, buf, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % cp), group, tag),
    ]
    stats.p2p_ops += len(ops)
    return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])  # one message per hop; V may be narrower


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Online softmax: fold a block's (out, lse) into the running ones, rows `rows`, fp32."""
    old_lse = lse[:, :, rows]  # [B, H, s]
    new_lse = torch.logaddexp(old_lse, block_lse)
    keep = torch.exp(old_lse - new_lse).transpose(1, 2)[..., None]  # [B, s, H, 1]
    take = torch.exp(block_lse - new_lse).transpose(1, 2)[..., None]
    out[:, rows] = out[:, rows] * keep + block_out * take
    lse[:, :, rows] = new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, zigzag, kernel: BlockKernel, stats):
        cp, rank, seq = group.size(), group.rank(), q.shape[1]
        out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=torch.float32)  # [B, S, Hq, Dv]
        lse = q.new_full((q.shape[0], q.shape[2], seq), float("-inf"), dtype=torch.float32)
        kv = _pack(k, v)
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:  # overlap: the next block is on its way while this one computes
                next_kv, works = _pass_to_next(kv, group, 0, stats)
            k_blk, v_blk = _unpack(kv, k.shape, v.shape)
            for rows, cols, blk_causal in ring_blocks(rank, src, seq, causal, zigzag):
                blk_out, blk_lse = kernel.forward(
                    q[:, rows], k_blk[:, cols], v_blk[:, cols], scale, blk_causal
                )
                _merge(out, lse, blk_out, blk_lse, rows)
            if step + 1 < cp:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, causal, zigzag, kernel, stats)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal, zigzag, kernel, stats = ctx.args
        cp, rank, seq = group.size(), group.rank(), q.shape[1]
        grad_out = grad_out.float().contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = _pack(k, v)
        partial_in, dkv_works = None, []  # partial dK/dV of the current block, from before
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:
                next_kv, kv_works = _pass_to_next(kv, group, 0, stats)
            k_blk, v_blk = _unpack(kv, k.shape, v.shape)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dk_blk, dv_blk = _unpack(dkv, k.shape, v.shape)
            for rows, cols, blk_causal in ring_blocks(rank, src, seq, causal, zigzag):
                dq_b, dk_b, dv_b = kernel.backward(
                    grad_out[:, rows], q[:, rows], k_blk[:, cols], v_blk[:, cols],
                    out[:, rows], lse[:, :, rows], scale, blk_causal,
                )  # fmt: skip
                dq[:, rows] += dq_b
                dk_blk[:, cols] += dk_b
                dv_blk[:, cols] += dv_b
            if partial_in is not None:
                _wait(dkv_works)
                dkv += partial_in
            if cp == 1:
                partial_in, dkv_works = dkv, []
                continue
            # Hand this block's dK/dV sum on; after cp hops each block's sum is home.
            partial_in, dkv_works = _pass_to_next(dkv, group, 1, stats)
            if step + 1 < cp:
                _wait(kv_works)
                kv = next_kv
        _wait(dkv_works)
        dk, dv = _unpack(partial_in, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence split across ranks: q [B, s, Hq, D], k [B, s, Hkv, D],
    v [B, s, Hkv, Dv] (s = S / cp) -> out [B, s, Hq, Dv], lse [B, Hq, s] (fp32).

    DTensor inputs must be `Shard(1)` on the mesh dim named `cp_dim` (of any mesh); the
    outputs are DTensors with the same placements (`Shard(2)` for the LSE's sequence dim).
    Plain tensors need `group`, the ring's process group.
    """
    block_kernel = resolve_kernel(kernel, q.device, q.shape[-1], v.shape[-1])
    stats = stats or RingStats()
    if not isinstance(q, DTensor):
        if group is None:
            raise ValueError(
                "ring_attention on plain tensors needs group=, the ring's process group"
            )
        return _RingAttention.apply(q, k, v, group, scale, causal, zigzag, block_kernel, stats)
    mesh, placements = q.device_mesh, q.placements
    cp_index = mesh.mesh_dim_names.index(cp_dim)
    for t in (q, k, v):
        if t.placements != placements or t.placements[cp_index] != Shard(1):
            raise ValueError(
                f"ring_attention needs q, k, v sharded Shard(1) (sequence) on mesh dim "
                f"{cp_dim!r}, got {[t.placements for t in (q, k, v)]}"
            )
    out, lse = _RingAttention.apply(
        q.to_local(), k.to_local(), v.to_local(), mesh.get_group(cp_dim),
        scale, causal, zigzag, block_kernel, stats,
    )  # fmt: skip
    lse_placements = [Shard(2) if p == Shard(1) else p for p in placements]
    return (
        DTensor.from_local(out, mesh, placements, run_check=False),
        DTensor.from_local(lse, mesh, lse_placements, run_check=False),
    )


class ContextParallelAttention(nn.Module):
    """Drop-in for `models.common.attention.AttentionCore` under context parallelism.

    The model hands it its local [B, s, H, D] tensors as usual (this rank's part of each
    sequence, s = S / cp); it runs the ring over the `cp` process group and hands back the
    local output. The model never learns that the sequence is split.
    """

    def __init__(
        self, scale: float, causal: bool, group: dist.ProcessGroup, zigzag: bool, kernel: str
    ):
        super().__init__()
        self.scale, self.causal, self.zigzag, self.kernel = scale, causal, zigzag, kernel
        self.group = group
        self.stats = RingStats()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = ring_attention(
            q, k, v, scale=self.scale, causal=self.causal, zigzag=self.zigzag,
            kernel=self.kernel, group=self.group, stats=self.stats,
        )  # fmt: skip
        return out

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, causal={self.causal}, zigzag={self.zigzag}, kernel={self.kernel}"


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
        ring = ContextParallelAttention(core.scale, core.causal, group, zigzag, kernel)
        setattr(model.get_submodule(parent_name), child, ring)
        installed.append(ring)
    return installed
