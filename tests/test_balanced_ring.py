"""`parallel.cp_layout=balanced`: each micro-batch laid out over the cp ranks by its
documents' work (moetrain.parallelisms.cp_schedule.balanced_table), one table read by the data split
and by the ring. Balance on the ring benchmark's lognormal documents, the ring against plain
masked attention on real gloo ranks, and kernel calls against an independent count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from moetrain.parallelisms.context_parallel import RingStats, ring_attention
from moetrain.parallelisms.cp_schedule import balanced_table, document_attention_work, split_for_cp
from moetrain.parallelisms.dims import CP_CHUNKS_PER_RANK
from tests.distributed import run_per_world
from tests.test_document_mask import (
    HKV,
    HQ,
    SCALE,
    D,
    edge_case_ids,
    masked_attention,
    short_document_ids,
    visible,
)

S = 64  # 8 chunks per rank at cp 2 and 4: chunks of 4 and 2 tokens


def lognormal_ids(seq: int, seed: int) -> torch.Tensor:
    """[1, seq]: documents of lognormal length (mean seq/4, sigma 1), as
    `benchmarks/ring_attention.py --docs-only` draws them."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(seq / 4), 1.0))))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:seq][None]


def _max_over_mean(visible_pairs: list[list[int]]) -> float:
    per_rank = [sum(steps) for steps in visible_pairs]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_layout_evens_out_the_visible_pairs(cp):
    worst_zigzag, worst_balanced = [], []
    for seed in range(4):
        ids = lognormal_ids(8192, seed)
        table = balanced_table(ids, cp)
        # a layout: every chunk once, CP_CHUNKS_PER_RANK each, ascending
        assert table.shape == (cp, CP_CHUNKS_PER_RANK)
        assert sorted(table.flatten().tolist()) == list(range(cp * CP_CHUNKS_PER_RANK))
        assert all(row == sorted(row) for row in table.tolist())
        # measured by the schedule's own count of visible pairs, not the table's estimate
        zigzag, _ = document_attention_work(ids, cp, True, True)
        balanced, _ = document_attention_work(ids, cp, True, False, table=table)
        worst_zigzag.append(_max_over_mean(zigzag))
        worst_balanced.append(_max_over_mean(balanced))
    print(f"cp={cp}: zigzag {np.mean(worst_zigzag):.3f}, balanced {np.mean(worst_balanced):.3f}")
    assert max(worst_balanced) <= 1.05
    assert np.mean(worst_balanced) < np.mean(worst_zigzag)


def test_the_split_is_a_permutation_the_table_undoes():
    ids = lognormal_ids(S, 7)
    cp, table = 4, balanced_table(ids, 4)
    x = torch.arange(S)[None]
    parts = [split_for_cp(x, r, cp, False, table) for r in range(cp)]
    chunks = torch.cat(parts, dim=1).view(cp * CP_CHUNKS_PER_RANK, -1)
    order = table.flatten().argsort()
    assert torch.equal(chunks[order].flatten(), x[0])


# --- the ring on real gloo ranks ----------------------------------------------------------


def _chunk_calls(ids, table, rank, cp) -> int:
    """Independent count of the kernel calls rank `rank` must make: (its chunk, any chunk)
    pairs in which the global mask has a visible pair."""
    mask, width = visible(ids, True), ids.shape[1] // table.numel()
    spans = [slice(c * width, (c + 1) * width) for c in range(table.numel())]
    return sum(
        bool(mask[:, spans[qc]][:, :, spans[kc]].any())
        for qc in table[rank].tolist()
        for kc in range(table.numel())
    )


def _ring_worker(rank: int, cp: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("dp", "cp"))
    results = {}
    cases = {"lognormal": torch.cat([lognormal_ids(S, 1), lognormal_ids(S, 2)]),
             "edge": torch.cat([_widen(edge_case_ids()), _widen(short_document_ids())])}  # fmt: skip
    for name, ids in cases.items():
        g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
        b = ids.shape[0]
        q, k, v = (torch.randn(b, S, h, D, generator=g) for h in (HQ, HKV, HKV))
        grad = torch.randn(b, S, HQ, D, generator=g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = masked_attention(*ref, visible(ids, True))
        ref_out.backward(grad)
        table = balanced_table(ids, cp)
        local = lambda t, table=table: split_for_cp(t, rank, cp, False, table)  # noqa: E731
        parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
        dts = [DTensor.from_local(t, mesh, [Shard(0), Shard(1)]) for t in parts]
        stats = RingStats()
        out, lse = ring_attention(*dts, scale=SCALE, causal=True, zigzag=False, stats=stats,
                                  document_ids=local(ids), table=table)  # fmt: skip
        out.to_local().backward(local(grad))
        ref_lse_local = local(ref_lse.transpose(1, 2)).transpose(1, 2)
        results[name] = {
            "errors": [
                (out.to_local() - local(ref_out)).abs().max().item(),
                (lse.to_local() - ref_lse_local).abs().max().item(),
                *((p.grad - local(r.grad)).abs().max().item() for p, r in zip(parts, ref)),
            ],
            "calls": (stats.kernel_calls, stats.backward_kernel_calls),
            "expected_calls": _chunk_calls(ids, table, rank, cp),
        }
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)


def _widen(ids: torch.Tensor) -> torch.Tensor:
    """The document mask tests' [B, 48] ids as [B, 64]: the last document runs on."""
    return torch.cat([ids, ids[:, -1:].expand(-1, S - ids.shape[1])], dim=1)


@pytest.mark.slow
def test_balanced_ring_matches_plain_masked_attention(tmp_path_factory):
    results = run_per_world(_ring_worker, (2, 4), tmp_path_factory, "balanced_ring")
    for cp, per_rank in results.items():
        for rank, cases in enumerate(per_rank):
            for name, r in cases.items():
                assert max(r["errors"]) < 1e-5, (cp, rank, name, r["errors"])
                assert r["calls"] == (r["expected_calls"],) * 2, (cp, rank, name, r)
