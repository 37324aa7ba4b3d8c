"""Ring attention on real gloo ranks against plain full attention (fp32), its p2p schedule,
and the causal balance of the zigzag layout."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import ProfilerActivity, profile

from moetrain.parallelisms.attention_kernels import KERNELS
from moetrain.parallelisms.context_parallel import RingStats, ring_attention
from moetrain.parallelisms.cp_schedule import attention_work, split_for_cp
from tests.distributed import run_per_world

B, S, HQ, HKV, D = 2, 48, 8, 2, 12  # GQA 8:2, head_dim not a power of two; S % (2 * 4) == 0
SCALE = D**-0.5
CASES = [(c, z, k) for c in (True, False) for z in (True, False) for k in ("math", "cpu_flash")]


def _full_attention(q, k, v, causal):
    """Plain attention on the whole sequence, with its LSE: the reference."""
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    k_, v_ = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k_, v_))
    scores = q_ @ k_.transpose(-1, -2) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v_).transpose(1, 2), scores.logsumexp(-1)


def _ring_worker(rank: int, cp: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("dp", "cp"))  # multi-dim mesh
    g = torch.Generator().manual_seed(0)  # same global tensors on every rank
    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (HQ, HKV, HKV))
    grad = torch.randn(B, S, HQ, D, generator=g)
    errors, p2p = {}, {}
    for causal, zigzag, kernel in CASES:
        ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = _full_attention(ref_q, ref_k, ref_v, causal)
        ref_out.backward(grad)

        def local(t, zigzag=zigzag):
            return split_for_cp(t, rank, cp, zigzag)

        parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
        dts = [DTensor.from_local(t, mesh, [Shard(0), Shard(1)]) for t in parts]
        stats = RingStats()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out, lse = ring_attention(
                *dts, scale=SCALE, causal=causal, zigzag=zigzag, kernel=kernel, stats=stats
            )
            forward_ops = stats.p2p_ops
            out.to_local().backward(local(grad))
        assert isinstance(out, DTensor) and out.placements == (Shard(0), Shard(1))
        collectives = {
            e.key for e in prof.key_averages() if e.key.startswith("c10d::") and "send" not in e.key
        } - {"c10d::recv_"}
        key = f"causal={causal},zigzag={zigzag},{kernel}"
        p2p[key] = (forward_ops, stats.p2p_ops - forward_ops, sorted(collectives))
        errors[key] = {
            "out": (out.to_local() - local(ref_out)).abs().max().item(),
            "lse": (
                lse.to_local()
                - split_for_cp(ref_lse.transpose(1, 2), rank, cp, zigzag).transpose(1, 2)
            )
            .abs()
            .max()
            .item(),
            "dq": (parts[0].grad - local(ref_q.grad)).abs().max().item(),
            "dk": (parts[1].grad - local(ref_k.grad)).abs().max().item(),
            "dv": (parts[2].grad - local(ref_v.grad)).abs().max().item(),
        }
    gathered = [None] * cp
    dist.all_gather_object(gathered, (errors, p2p))
    if rank == 0:
        torch.save(gathered, out_path)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    return run_per_world(_ring_worker, (2, 4), tmp_path_factory, "cp")


def _max_errors(per_rank):
    worst = {}
    for errors, _ in per_rank:
        for case, errs in errors.items():
            worst[case] = max(worst.get(case, 0.0), *errs.values())
    return worst


@pytest.mark.slow
def test_ring_matches_full_attention(ring_results):
    for cp, per_rank in ring_results.items():
        for case, err in _max_errors(per_rank).items():
            assert err < 1e-5, f"cp={cp} {case}: max |error| {err:.2e} (out, lse, dq, dk, dv)"


@pytest.mark.slow
def test_error_does_not_grow_with_cp(ring_results):
    err2, err4 = _max_errors(ring_results[2]), _max_errors(ring_results[4])
    for case in err2:
        # Same fp32 merge per block however many blocks: allow noise, not growth.
        assert err4[case] <= 2 * err2[case] + 1e-6, (case, err2[case], err4[case])


@pytest.mark.slow
def test_point_to_point_ops_match_the_schedule(ring_results):
    for cp, per_rank in ring_results.items():
        for _, p2p in per_rank:
            for case, (forward, backward, collectives) in p2p.items():
                # forward: K/V make cp-1 hops (a send and a receive each); backward: K/V again,
                # plus cp hops of the dK/dV partial sums home.
                assert forward == 2 * (cp - 1), case
                assert backward == 2 * (cp - 1) + 2 * cp, case
                assert collectives == [], f"{case}: unexpected collectives {collectives}"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    seq = 64 * cp
    zigzag = attention_work(cp, seq, causal=True, zigzag=True)
    naive = attention_work(cp, seq, causal=True, zigzag=False)
    assert sum(zigzag) == sum(naive) == seq * (seq + 1) // 2  # every causal pair exactly once
    ratio = max(zigzag) / (sum(zigzag) / cp)
    naive_ratio = max(naive) / (sum(naive) / cp)
    assert ratio <= 1.01, ratio
    assert naive_ratio > 1.3  # what the zigzag layout fixes: ~2cp/(cp+1)


def test_block_kernels_match_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 9, h, D, generator=g, requires_grad=True) for h in (HQ, HKV, HKV))
    for causal in (True, False):
        ref = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, scale=0.3, enable_gqa=True
        ).transpose(1, 2)
        grad = torch.randn(ref.shape, generator=g)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        for kernel in (KERNELS["math"], KERNELS["cpu_flash"]):  # CUDA's: tests/test_gpu.py
            with torch.no_grad():
                out, lse = kernel.forward(q, k, v, 0.3, causal)
                grads = kernel.backward(grad, q, k, v, out, lse, 0.3, causal)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            for ours, theirs in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
