"""The context-parallel schedule: pure arithmetic on ranks and sequence positions.

Who holds which part of a sequence (`split_for_cp`, applied once in the data path to
tokens, labels and positions), which query x key rows meet on each ring step
(`ring_blocks`, used by the ring), and the work that gives each rank (`attention_work`,
the load-balance measure). No communication and no tensors but the split itself, so the
data path imports it without the ring.

Zigzag: the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r, so
that under a causal mask every rank does the same work.
"""

from __future__ import annotations

import torch

Block = tuple[slice, slice, bool]  # (query rows, key rows, causal within the block)


def ring_blocks(rank: int, src: int, seq_local: int, causal: bool, zigzag: bool) -> list[Block]:
    """Which (query rows x key rows) of this rank meet the K/V block owned by `src`."""
    full = slice(0, seq_local)
    if not causal:
        return [(full, full, False)]
    if src == rank:  # own block: causal over the local rows (they are in position order)
        return [(full, full, True)]
    if not zigzag:  # contiguous split: earlier ranks are fully visible, later ones not at all
        return [(full, full, False)] if src < rank else []
    half = seq_local // 2
    if src < rank:  # both my chunks come after src's first chunk, before its second
        return [(full, slice(0, half), False)]
    return [(slice(half, seq_local), full, False)]  # my second chunk sees all of src's


def attention_work(cp: int, seq_len: int, causal: bool, zigzag: bool) -> list[int]:
    """Query-key pairs each rank computes over a whole ring pass (the load-balance measure)."""
    seq_local = seq_len // cp
    work = []
    for rank in range(cp):
        pairs = 0
        for src in range(cp):
            for q, k, block_causal in ring_blocks(rank, src, seq_local, causal, zigzag):
                n_q, n_k = q.stop - q.start, k.stop - k.start
                pairs += n_q * (n_q + 1) // 2 if block_causal else n_q * n_k
        work.append(pairs)
    return work


def split_for_cp(x: torch.Tensor, cp_rank: int, cp: int, zigzag: bool) -> torch.Tensor:
    """This rank's part of [B, S, ...] along the sequence: chunks r and 2cp-1-r (zigzag) or
    chunk r. Applied once to tokens, labels and positions in the data path."""
    if not zigzag:
        return x.chunk(cp, dim=1)[cp_rank]
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=1)
