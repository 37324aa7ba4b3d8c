"""What one rank computes at each step of the ring (`moetrain.parallelisms.context_parallel`): the
ring's state (`Ring`: its group, the attention's shape, the block kernel, the pieces forward
chose for backward), and each step's blocks with their masks (`step_blocks`). No
communication: a ring simulated in one process (tests/test_gpu.py) runs the same steps."""

from __future__ import annotations

import torch

from moetrain.models.common.visibility import Visibility
from moetrain.parallelisms.attention_kernels import BlockKernel
from moetrain.parallelisms.cp_schedule import document_blocks, local_positions, ring_blocks
from moetrain.parallelisms.ring_messages import RingStats


class Ring:
    """What a ring needs besides q, k, v: its process group, the attention's shape (and
    sliding window) and the block kernel; `stats` counts the point-to-point operations it
    posts."""

    def __init__(
        self,
        group,
        scale,
        causal,
        zigzag,
        kernel: BlockKernel,
        stats: RingStats,
        window=None,
        table=None,
    ):
        self.group, self.scale, self.causal, self.zigzag = group, scale, causal, zigzag
        self.kernel, self.stats, self.window = kernel, stats, window
        self.table = table  # a balanced layout's chunks per rank (cp_schedule.balanced_table)
        # Document masks: the (rows, cols) pieces of each ring step, decided in forward and
        # reused by backward, so both skip the same block pairs (and backward reads no mask
        # bounds back from the device).
        self.pieces: list[list[tuple[slice, slice]]] = []
        self._positions: dict[int, torch.Tensor] = {}

    def positions(self, rank: int, seq: int, device: torch.device) -> torch.Tensor:
        """Global positions of `rank`'s local rows (computed once per ring and rank)."""
        if rank not in self._positions:
            cp = self.group.size()
            pos = local_positions(rank, cp, seq, self.zigzag, self.table)
            self._positions[rank] = pos.to(device)
        return self._positions[rank]


def step_blocks(ring: Ring, step: int, src: int, seq: int, ids, k_ids):
    """(rows, cols, causal, mask) of one ring step: `ring_blocks` without document ids or
    window; with them the visible pieces (the mask, a `Visibility`, carries the causality).
    A window alone is a mask over one document: `ids` and `k_ids` are zeros then."""
    cp, rank, window = ring.group.size(), ring.group.rank(), ring.window
    if ids is None:
        return [
            (r, c, bc, None) for r, c, bc in ring_blocks(rank, src, seq, ring.causal, ring.zigzag)
        ]
    if step == len(ring.pieces):  # forward: which pieces does any query see into?
        pieces = document_blocks(
            rank, src, cp, ids, k_ids, ring.causal, ring.zigzag, window, ring.table
        )
        ring.pieces.append(pieces)
    q_pos, k_pos = (ring.positions(r, seq, ids.device) for r in (rank, src))
    if ring.kernel.whole_blocks:  # the kernel skips the tiles nobody sees by itself
        if not ring.pieces[step]:
            return []
        whole = slice(0, seq)
        vis = Visibility(ids, k_ids, q_pos, k_pos, ring.causal, window)
        return [(whole, whole, False, vis)]
    # The mask travels as its description: a math kernel materialises it.
    return [
        (
            rows,
            cols,
            False,
            Visibility(ids[:, rows], k_ids[:, cols], q_pos[rows], k_pos[cols], ring.causal, window),
        )
        for rows, cols in ring.pieces[step]
    ]


def mask_ids(ids, k_ids, ring: Ring, q: torch.Tensor):
    """The document ids the masks read: the block's own, or zeros for a window alone."""
    if ids is None and ring.window is not None:
        zeros = torch.zeros(q.shape[:2], dtype=torch.int64, device=q.device)
        return zeros, zeros
    return ids, k_ids


def sink_lse(sinks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sinks [Hq] -> [B, Hq, s] fp32: a block with that LSE and output 0 (each row's sink)."""
    return sinks.float()[None, :, None].expand(q.shape[0], q.shape[2], q.shape[1])
