"""Sliding windows and attention sinks on every attention path: the plain core and the ring
at cp 2, 3 and 4 (zigzag and contiguous, with and without document masks) against a plain
reference written here from the definitions; and the kernel calls the window saves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moetrain.models.common.attention import AttentionCore
from moetrain.parallelisms.context_parallel import RingStats, ring_attention
from moetrain.parallelisms.cp_schedule import local_positions, split_for_cp
from tests.distributed import run_per_world

B, S, HQ, HKV, D = 2, 48, 4, 2, 8  # S splits into 2 * cp chunks for cp = 2, 3, 4
SCALE = D**-0.5


def _documents() -> torch.Tensor:
    ids = torch.zeros(B, S, dtype=torch.int64)
    ids[0, 11:] = 1
    ids[0, 30:] = 2
    ids[1, 40:] = 1
    return ids


def _visible(ids: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """[B, S, S]: query i sees key j (causal, same document, within the window)."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = (j <= i).expand(B, S, S).clone()
    if ids is not None:
        seen &= ids[:, :, None] == ids[:, None, :]
    if window is not None:
        seen &= (i - j) < window
    return seen


def _reference(q, k, v, ids, window, sinks):
    """Attention written out: scores, the mask, each head's sink as one more logit."""
    qh = q.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    scores = (qh @ kh.transpose(-1, -2) * SCALE).masked_fill(
        ~_visible(ids, window)[:, None], float("-inf")
    )
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, HQ, 1, 1).expand(B, HQ, S, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :S]
    return (probs @ vh).transpose(1, 2), scores.logsumexp(-1)  # [B, S, HQ, D], [B, HQ, S]


def _cases(cp: int) -> list[tuple]:
    chunk = S // (2 * cp)  # a zigzag chunk
    windows = (chunk // 2, chunk, 2 * chunk + 1)
    return [
        (zigzag, window, with_sinks, with_ids)
        for zigzag in (True, False)
        for window in windows
        for with_sinks in (False, True)
        for with_ids in (False, True)
    ]


def _expected_calls(rank: int, cp: int, zigzag: bool, ids, window) -> int:
    """Chunk pairs with any visible query-key pair, counted from the mask itself."""
    seen = _visible(ids, window).any(0)  # [S, S]: over the batch, as one kernel call does
    seq_local = S // cp
    q_pos = local_positions(rank, cp, seq_local, zigzag)
    n_chunks = 2 if zigzag else 1
    calls = 0
    for src in range(cp):
        k_pos = local_positions(src, cp, seq_local, zigzag)
        for qc in q_pos.chunk(n_chunks):
            for kc in k_pos.chunk(n_chunks):
                calls += bool(seen[qc][:, kc].any())
    return calls


def _variants_worker(rank: int, cp: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(B, S, h, D, generator=g, dtype=torch.float64).float() for h in (HQ, HKV, HKV)
    )
    grad = torch.randn(B, S, HQ, D, generator=g)
    sinks_value = torch.tensor([2.0, -1.0, 8.0, 0.5])  # one large: it dominates some rows
    results = {}
    for zigzag, window, with_sinks, with_ids in _cases(cp):
        ids = _documents() if with_ids else None
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks_value.clone().requires_grad_() if with_sinks else None
        ref_out, ref_lse = _reference(*ref_in, ids, window, ref_sinks)
        ref_out.backward(grad)

        def local(t, zigzag=zigzag):
            return split_for_cp(t, rank, cp, zigzag)

        parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
        sinks = sinks_value.clone().requires_grad_() if with_sinks else None
        stats = RingStats()
        out, lse = ring_attention(
            *parts, scale=SCALE, causal=True, zigzag=zigzag, kernel="auto", group=group,
            stats=stats, document_ids=local(ids) if ids is not None else None, window=window,
            sinks=sinks,
        )  # fmt: skip
        out.backward(local(grad))
        errors = {
            "out": (out - local(ref_out)).abs().max().item(),
            "lse": (lse - local(ref_lse.transpose(1, 2)).transpose(1, 2)).abs().max().item(),
            **{
                n: (p.grad - local(r.grad)).abs().max().item()
                for n, p, r in zip("qkv", parts, ref_in)
            },
        }
        if with_sinks:  # the ranks' shares of the sinks' gradient sum to the reference's
            dist.all_reduce(sinks.grad)
            errors["sinks"] = (sinks.grad - ref_sinks.grad).abs().max().item()
        key = (zigzag, window, with_sinks, with_ids)
        results[key] = (errors, stats.kernel_calls, _expected_calls(rank, cp, zigzag, ids, window))
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)


@pytest.fixture(scope="module")
def ring_variants(tmp_path_factory):
    return run_per_world(_variants_worker, (2, 3, 4), tmp_path_factory, "variants")


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_with_windows_and_sinks_matches_plain_attention(ring_variants, cp):
    for per_rank in ring_variants[cp]:
        for case, (errors, _, _) in per_rank.items():
            worst = max(errors.values())
            assert worst < 1e-5, f"cp={cp} zigzag, window, sinks, ids = {case}: {errors}"


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_window_skips_the_chunk_pairs_it_hides(ring_variants, cp):
    for rank, per_rank in enumerate(ring_variants[cp]):
        for (zigzag, window, _, _), (_, calls, expected) in per_rank.items():
            assert calls == expected, (cp, rank, zigzag, window, calls, expected)
    # The shortest window calls the kernel on fewer chunk pairs than causal attention needs.
    short = S // (2 * cp) // 2
    calls = sum(r[(True, short, False, False)][1] for r in ring_variants[cp])
    causal = sum(_expected_calls(rank, cp, True, None, None) for rank in range(cp))
    assert calls < causal, (calls, causal)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_ids", [False, True])
def test_the_plain_core_takes_windows_sinks_and_documents(window, with_ids):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    sinks = torch.tensor([2.0, -1.0, 8.0, 0.5], dtype=torch.float64)
    ins = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ids = _documents() if with_ids else None
    out = AttentionCore(SCALE, causal=True, window=window)(*ins[:3], ids, ins[3])
    refs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref, _ = _reference(*refs[:3], ids, window, refs[3])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(out, ins, grad)
    theirs = torch.autograd.grad(ref, refs, grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
