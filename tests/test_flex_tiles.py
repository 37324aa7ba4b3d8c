"""FlexAttention's tile tables, built from a block's rule (moetrain/models/common/flex.py): every
(q tile, k tile) holding a visible pair is listed, and a tile is called full only when
every pair in it is visible; on the ring's zigzag blocks, with documents, windows and
none, causal or not. (The kernel itself needs CUDA: tests/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.models.common.flex import TILE, _sparse_tiles
from moetrain.models.common.visibility import Visibility
from moetrain.parallelisms.attention_kernels import KERNELS
from moetrain.parallelisms.cp_schedule import local_positions, split_for_cp


def _documents(b: int, s: int) -> torch.Tensor:
    ids = torch.zeros(b, s, dtype=torch.int64)
    for row in range(b):
        for start in range(s // 7 + row * 13, s, s // 5):
            ids[row, start:] += 1
    return ids


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_tiles_cover_every_visible_pair_and_full_means_full(cp):
    s = 1000  # not a multiple of the tile: ragged last tiles
    ids, listed, visible_tiles = _documents(2, s), 0, 0
    for rank in range(cp):
        q_pos = local_positions(rank, cp, s // cp, zigzag=True)
        for src in range(cp):
            k_pos = local_positions(src, cp, s // cp, zigzag=True)
            q_ids, k_ids = (split_for_cp(ids, r, cp, zigzag=True) for r in (rank, src))
            for causal, window in [(True, None), (True, 100), (False, 77), (False, None)]:
                vis = Visibility(q_ids, k_ids, q_pos, k_pos, causal, window)
                dense = vis.dense()  # [B, Sq, Sk]
                sq, sk = dense.shape[1:]
                tiles_any, tiles_all = (t[:, 0] for t in _sparse_tiles(vis, sq, sk))
                bits = F.pad(dense, (0, -sk % TILE, 0, -sq % TILE))
                bits = bits.unflatten(1, (-1, TILE)).unflatten(3, (-1, TILE))  # [B, nq, T, nk, T]
                seen, full = bits.any(4).any(2), bits.all(4).all(2)
                assert not (seen & ~tiles_any).any(), (rank, src, causal, window)
                assert not (tiles_all & ~full).any(), (rank, src, causal, window)
                listed, visible_tiles = (
                    listed + int(tiles_any.sum()),
                    visible_tiles + int(seen.sum()),
                )
    # The ranges' slack (a tile straddling two zigzag chunks or two documents): a cost only.
    assert listed <= 1.5 * visible_tiles


def test_flex_block_forward_reads_the_rule():
    """Eager flex (CPU: forward only) with the rule as its mask_mod equals the math kernel,
    rows that see no key included (out 0, lse -inf)."""
    g = torch.Generator().manual_seed(0)
    b, s = 2, 200
    q = torch.randn(b, s, 4, 16, generator=g)
    k, v = (torch.randn(b, s, 2, 16, generator=g) for _ in "kv")
    ids, pos = _documents(b, s), torch.arange(s)
    for vis in (Visibility(ids, ids, pos, pos, True, 30), Visibility(ids, ids, pos, pos + 3, True)):
        ours = KERNELS["flex"].forward(q, k, v, 0.25, False, vis)
        ref = KERNELS["math"].forward(q, k, v, 0.25, False, vis)
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(ours[1].isinf(), ref[1].isinf())
        finite = ref[1].isfinite()
        torch.testing.assert_close(ours[1][finite], ref[1][finite], rtol=1e-5, atol=1e-5)
