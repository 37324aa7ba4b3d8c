"""The context-parallel schedule: pure arithmetic on ranks and sequence positions.

Who holds which part of a sequence (`split_for_cp`, applied once in the data path to
tokens, labels, positions and document ids), which query x key rows meet on each ring step
(`ring_blocks`, used by the ring; `document_blocks` under document masks), and the work
that gives each rank (`attention_work`; `document_attention_work` under document masks: the
load-balance measures). No communication, so the data path imports it without the ring.

Zigzag: the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r, so
that under a causal mask every rank does the same work.

Document masks (a query sees the keys of its own document, causally) and sliding windows
(a query sees the keys fewer than `window` positions before it): a pair of chunks,
one of the query rank's and one of the key block's, is computed only where some query
sees some key, trimmed to the rows and columns that take part; a chunk pair where no query
sees any key is not computed at all (nor masked, for a pair wholly outside the window).
Which pairs those are depends on the document ids (data), so `document_blocks` takes them; the causal structure comes from the chunks'
global positions, never from `position_ids` (which may restart at each document).
"""

from __future__ import annotations

import torch

from moetrain.models.common.visibility import block_mask, document_positions
from moetrain.parallelisms.dims import CP_CHUNKS_PER_RANK

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


def _chunks(
    rank: int, cp: int, seq_local: int, zigzag: bool, table: torch.Tensor | None = None
) -> list[tuple[int, slice]]:
    """This rank's chunks: (global chunk index, its local rows). Zigzag: chunks r and 2cp-1-r
    of 2cp; contiguous: chunk r of cp (indices comparable only within one layout); a
    balanced `table` [cp, k]: the chunks its row names, of cp * k."""
    if table is not None:
        width = seq_local // table.shape[1]
        return [(int(c), slice(j * width, (j + 1) * width)) for j, c in enumerate(table[rank])]
    if not zigzag:
        return [(rank, slice(0, seq_local))]
    half = seq_local // 2
    return [(rank, slice(0, half)), (2 * cp - 1 - rank, slice(half, seq_local))]


def local_positions(
    rank: int, cp: int, seq_local: int, zigzag: bool, table: torch.Tensor | None = None
) -> torch.Tensor:
    """Global sequence index of each of this rank's local rows, [seq_local] int64."""
    return split_for_cp(torch.arange(seq_local * cp)[None], rank, cp, zigzag, table)[0]


def _out_of_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> bool:
    """Whether every (query, key) of two chunks (global positions, ascending) lies at least
    `window` positions apart: the pair needs no kernel call and not even a mask."""
    if window is None:
        return False
    gap = max(int(q_pos[0]) - int(k_pos[-1]), int(k_pos[0]) - int(q_pos[-1]))
    return gap >= window


def document_blocks(
    rank: int,
    src: int,
    cp: int,
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    causal: bool,
    zigzag: bool,
    window: int | None = None,
    table: torch.Tensor | None = None,
) -> list[tuple[slice, slice]]:
    """The (query rows, key rows) pieces this rank computes against the K/V block of `src`
    under document masks or a sliding window. q_ids, k_ids: [B, s] document ids of this
    rank's and src's rows (all one document for a window alone).

    One piece per chunk pair (query chunk, key chunk) in which some query sees some key,
    trimmed to the bounding box of the rows and columns that do; chunk pairs with no visible
    pair are left out. The mask inside a piece is `block_mask` on its rows and columns.
    """
    seq_local = q_ids.shape[1]
    q_pos = local_positions(rank, cp, seq_local, zigzag, table).to(q_ids.device)
    k_pos = local_positions(src, cp, seq_local, zigzag, table).to(q_ids.device)
    pieces = []
    for q_chunk, rows in _chunks(rank, cp, seq_local, zigzag, table):
        for k_chunk, cols in _chunks(src, cp, seq_local, zigzag, table):
            if causal and k_chunk > q_chunk:  # every key comes after every query
                continue
            if _out_of_window(q_pos[rows], k_pos[cols], window):
                continue
            mask = block_mask(
                q_ids[:, rows], k_ids[:, cols], q_pos[rows], k_pos[cols], causal, window
            )
            mask = mask.any(0)  # [nq, nk]: over the batch, which one kernel call covers
            seen_rows, seen_cols = mask.any(1).int(), mask.any(0).int()
            # Whether any pair is visible, and the first/last seen row and column (counted
            # from each end): one read back from the device for all five.
            seen, r0, r1, c0, c1 = torch.stack(
                [
                    seen_rows.max(),
                    seen_rows.argmax(),
                    seen_rows.flip(0).argmax(),
                    seen_cols.argmax(),
                    seen_cols.flip(0).argmax(),
                ]
            ).tolist()
            if not seen:
                continue
            pieces.append(
                (
                    slice(rows.start + r0, rows.stop - r1),
                    slice(cols.start + c0, cols.stop - c1),
                )
            )
    return pieces


def document_attention_work(
    document_ids: torch.Tensor,
    cp: int,
    causal: bool,
    zigzag: bool,
    window: int | None = None,
    table: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """The load-balance measure under document masks, for a micro-batch's document ids
    [B, S] (before the split): per rank and ring step, (visible query-key pairs, pairs the
    block kernel computes: the trimmed pieces' areas). Index [rank][step]; at step t rank r
    meets the K/V block of rank (r - t) mod cp, as the ring does."""
    seq_local = document_ids.shape[1] // cp
    ids = [split_for_cp(document_ids, r, cp, zigzag, table) for r in range(cp)]
    visible, computed = [], []
    for rank in range(cp):
        q_pos = local_positions(rank, cp, seq_local, zigzag, table)
        seen, done = [], []
        for step in range(cp):
            src = (rank - step) % cp
            k_pos = local_positions(src, cp, seq_local, zigzag, table)
            n_seen = n_done = 0
            pieces = document_blocks(
                rank, src, cp, ids[rank], ids[src], causal, zigzag, window, table
            )
            for rows, cols in pieces:
                mask = block_mask(
                    ids[rank][:, rows], ids[src][:, cols], q_pos[rows], k_pos[cols], causal, window
                )
                n_seen += int(mask.sum())
                n_done += mask.numel()
            seen.append(n_seen)
            done.append(n_done)
        visible.append(seen)
        computed.append(done)
    return visible, computed


def split_for_cp(
    x: torch.Tensor, cp_rank: int, cp: int, zigzag: bool, table: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's part of [B, S, ...] along the sequence: chunks r and 2cp-1-r (zigzag),
    chunk r, or the chunks row r of a balanced `table` names. Applied once to tokens,
    labels, positions and document ids in the data path."""
    if table is not None:
        chunks = x.chunk(table.numel(), dim=1)
        return torch.cat([chunks[int(c)] for c in table[cp_rank]], dim=1)
    if not zigzag:
        return x.chunk(cp, dim=1)[cp_rank]
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=1)


def balanced_table(document_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """`parallel.cp_layout=balanced`: which chunks each rank holds for one micro-batch,
    [cp, CP_CHUNKS_PER_RANK] int64, each row ascending (so a rank's rows stay in position
    order). The sequence is cut into cp * CP_CHUNKS_PER_RANK chunks; a chunk's work is the
    query-key pairs its queries see (over the micro-batch); chunks go, largest first, to the
    rank with the least work that still has room. Every rank computes the same table from
    the same ids, and the ring reads it for the masks' global positions."""
    s = document_ids.shape[1]
    n = cp * CP_CHUNKS_PER_RANK
    # keys each query sees under the causal document mask: the earlier tokens of its
    # document and itself. NOTE: a sliding window is not weighed (its layers share the table)
    seen = document_positions(document_ids) + 1  # [B, S]
    work = seen.sum(0).view(n, s // n).sum(1).tolist()
    load, held = [0] * cp, [[] for _ in range(cp)]
    for chunk in sorted(range(n), key=lambda c: -work[c]):
        rank = min(
            (r for r in range(cp) if len(held[r]) < CP_CHUNKS_PER_RANK), key=lambda r: load[r]
        )
        held[rank].append(chunk)
        load[rank] += work[chunk]
    return torch.tensor([sorted(h) for h in held], dtype=torch.int64)
