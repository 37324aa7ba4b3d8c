"""Document masks: a token attends only to earlier tokens of its own packed document.

The ring (cp 2 and 4, zigzag and contiguous, GQA and v_head_dim != head_dim) against plain
masked attention on the whole sequence (fp32: out, LSE, dQ, dK, dV); the ring's skipped
block pairs against an independent count from the global mask; the plain path, the block
kernel's rows that see nothing, reset positions; transformers on each document alone
against our model on the packed sample. Through train.py: tests/test_document_mask_train.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from moetrain.config.load import load_config
from moetrain.data.packing import PackedDataset, document_positions
from moetrain.loop.preflight import check_cp_kernel
from moetrain.models.common.attention import AttentionCore
from moetrain.parallelisms import ring_messages
from moetrain.parallelisms.attention_kernels import KERNELS, resolve_kernel
from moetrain.parallelisms.context_parallel import RingStats, ring_attention
from moetrain.parallelisms.cp_schedule import attention_work, document_attention_work, split_for_cp
from moetrain.parallelisms.dims import LayoutError
from tests.distributed import ROOT, run_per_world
from tests.families import FAMILIES
from tests.families.models import hf_model as tiny_hf_model
from tests.families.models import ours_from_dir

B, S, HQ, HKV, D = 4, 48, 8, 2, 12  # S splits into 2 * 4 chunks of 6
SCALE = D**-0.5


def _ids_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def edge_case_ids() -> torch.Tensor:
    """[4, S]: documents crossing chunk boundaries with single-token ones among them; one
    document spanning the whole sequence (no boundary at all); every token its own
    document; random lengths."""
    g = torch.Generator().manual_seed(3)
    random = torch.cumsum((torch.rand(S, generator=g) < 0.15).long(), 0)
    return torch.stack(
        [
            _ids_from_lengths([7, 1, 13, 1, 1, 20, 5]),
            torch.zeros(S, dtype=torch.long),
            torch.arange(S),
            random - random[0],
        ]
    )


def short_document_ids() -> torch.Tensor:
    """[2, S] of documents no longer than 5 tokens: many chunk pairs see nothing."""
    return torch.stack(
        [_ids_from_lengths([5, 3, 5, 2, 4, 5, 1, 5, 4, 3, 5, 2, 4]), _ids_from_lengths([4] * 12)]
    )


def visible(ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference mask [B, S, S], written out directly."""
    seq = ids.shape[1]
    mask = ids[:, :, None] == ids[:, None, :]
    if causal:
        mask &= torch.arange(seq)[:, None] >= torch.arange(seq)[None, :]
    return mask


def masked_attention(q, k, v, mask):
    """Plain attention under a mask [B, Sq, Sk] (True = seen), with its LSE."""
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    k_, v_ = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=1) for t in (k_, v_))
    scores = (q_ @ k_.transpose(-1, -2) * SCALE).masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ v_).transpose(1, 2), scores.logsumexp(-1)


def nonempty_chunk_pairs(ids, rank, cp, causal, zigzag) -> int:
    """Independent count of the kernel calls rank `rank` must make: chunk pairs (one of its
    chunks x one of any rank's chunks) in which the global mask has a visible pair."""
    mask, seq_local = visible(ids, causal), ids.shape[1] // cp

    def chunks(r):
        pos = split_for_cp(torch.arange(ids.shape[1])[None], r, cp, zigzag)[0]
        return [pos] if not zigzag else [pos[: seq_local // 2], pos[seq_local // 2 :]]

    return sum(
        bool(mask[:, qc][:, :, kc].any())
        for src in range(cp)
        for qc in chunks(rank)
        for kc in chunks(src)
    )


# --- the ring on real gloo ranks ----------------------------------------------------------


def _ring_worker(rank: int, cp: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("dp", "cp"))
    results = {}
    for id_case, ids in (("edge", edge_case_ids()), ("short", short_document_ids())):
        for dv in (D, 8):  # GQA with equal head dims; MLA-like narrower values
            g = torch.Generator().manual_seed(dv)  # same global tensors on every rank
            b = ids.shape[0]
            q, k, v = (
                torch.randn(b, S, h, d, generator=g) for h, d in ((HQ, D), (HKV, D), (HKV, dv))
            )
            grad = torch.randn(b, S, HQ, dv, generator=g)
            for causal in (True, False):
                for zigzag in (True, False):
                    key = f"{id_case},dv={dv},causal={causal},zigzag={zigzag}"
                    results[key] = _ring_case(rank, cp, mesh, q, k, v, grad, ids, causal, zigzag)
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)


def _ring_case(rank, cp, mesh, q, k, v, grad, ids, causal, zigzag) -> dict:
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = masked_attention(*ref, visible(ids, causal))
    ref_out.backward(grad)

    def local(t):
        return split_for_cp(t, rank, cp, zigzag)

    parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
    dts = [DTensor.from_local(t, mesh, [Shard(0), Shard(1)]) for t in parts]
    # The ids as a DTensor on one layout, as this rank's plain part on the other.
    doc = local(ids)
    doc = DTensor.from_local(doc, mesh, [Shard(0), Shard(1)]) if zigzag else doc
    stats = RingStats()
    out, lse = ring_attention(
        *dts, scale=SCALE, causal=causal, zigzag=zigzag, stats=stats, document_ids=doc
    )
    forward_p2p = stats.p2p_ops
    out.to_local().backward(local(grad))
    ref_lse_local = split_for_cp(ref_lse.transpose(1, 2), rank, cp, zigzag).transpose(1, 2)
    return {
        "errors": {
            "out": (out.to_local() - local(ref_out)).abs().max().item(),
            "lse": (lse.to_local() - ref_lse_local).abs().max().item(),
            "dq": (parts[0].grad - local(ref[0].grad)).abs().max().item(),
            "dk": (parts[1].grad - local(ref[1].grad)).abs().max().item(),
            "dv": (parts[2].grad - local(ref[2].grad)).abs().max().item(),
        },
        "finite": all(bool(t.isfinite().all()) for t in (out.to_local(), *(p.grad for p in parts))),
        "calls": (stats.kernel_calls, stats.backward_kernel_calls),
        "expected_calls": nonempty_chunk_pairs(ids, rank, cp, causal, zigzag),
        "p2p": (forward_p2p, stats.p2p_ops - forward_p2p),
        # Calls without any boundary: what the mask lets the ring skip is the difference.
        "unmasked_calls": nonempty_chunk_pairs(torch.zeros_like(ids[:1]), rank, cp, causal, zigzag),
        "pairs": stats.pairs,
    }


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    return run_per_world(_ring_worker, (2, 4), tmp_path_factory, "doc_cp")


@pytest.mark.slow
def test_ring_with_document_masks_matches_plain_masked_attention(ring_results):
    for cp, per_rank in ring_results.items():
        for rank, cases in enumerate(per_rank):
            for case, r in cases.items():
                worst = max(r["errors"].values())
                assert worst < 1e-5, f"cp={cp} rank {rank} {case}: {r['errors']}"
                assert r["finite"], f"cp={cp} rank {rank} {case}: NaN or inf"


@pytest.mark.slow
def test_ring_skips_exactly_the_empty_block_pairs(ring_results):
    for cp, per_rank in ring_results.items():
        skipped = 0
        for rank, cases in enumerate(per_rank):
            for case, r in cases.items():
                forward, backward = r["calls"]
                assert forward == backward == r["expected_calls"], (cp, rank, case, r["calls"])
                # The ids ride in the K/V message: no extra point-to-point operation.
                assert r["p2p"] == (2 * (cp - 1), 2 * (cp - 1) + 2 * cp), (cp, case)
                skipped += r["unmasked_calls"] - forward
        assert skipped > 0, f"cp={cp}: nothing was skipped"


@pytest.mark.slow
def test_computed_pairs_match_the_schedule(ring_results):
    """The ring's own count of computed pairs equals `document_attention_work`'s."""
    for cp, per_rank in ring_results.items():
        for id_case, ids in (("edge", edge_case_ids()), ("short", short_document_ids())):
            for causal in (True, False):
                for zigzag in (True, False):
                    _, computed = document_attention_work(ids, cp, causal, zigzag)
                    for rank, cases in enumerate(per_rank):
                        r = cases[f"{id_case},dv={D},causal={causal},zigzag={zigzag}"]
                        assert r["pairs"] == sum(computed[rank])


# --- pieces on one process ---------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_document_work_counts_visible_pairs(cp, zigzag):
    ids = torch.cat([edge_case_ids(), short_document_ids()])
    seen, computed = document_attention_work(ids, cp, causal=True, zigzag=zigzag)
    mask = visible(ids, causal=True)
    for rank in range(cp):
        rows = split_for_cp(torch.arange(S)[None], rank, cp, zigzag)[0]
        assert sum(seen[rank]) == int(mask[:, rows].sum())
        assert sum(computed[rank]) >= sum(seen[rank])
    # No boundary: exactly the causal work of every rank.
    one_doc = torch.zeros(1, S, dtype=torch.long)
    seen, _ = document_attention_work(one_doc, cp, causal=True, zigzag=zigzag)
    assert [sum(r) for r in seen] == attention_work(cp, S, causal=True, zigzag=zigzag)


def test_math_kernel_rows_that_see_nothing_stay_finite():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, h, D, generator=g) for h in (HQ, HKV, HKV))
    mask = torch.rand(2, 5, 7, generator=g) < 0.5
    mask[:, 1] = False  # a query row with no visible key in this block
    k, v = (torch.randn(2, 7, HKV, D, generator=g) for _ in range(2))
    out, lse = KERNELS["math"].forward(q, k, v, SCALE, False, mask)
    assert out[:, 1].abs().max() == 0 and bool((lse[:, :, 1] == float("-inf")).all())
    assert out.isfinite().all()
    ref_out, ref_lse = masked_attention(q, k, v, mask)
    seen = mask.any(-1)  # [2, 5]
    torch.testing.assert_close(out[seen], ref_out[seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.transpose(1, 2)[seen], ref_lse.transpose(1, 2)[seen])
    # Folding an empty row into an empty running row: still (0, -inf), no NaN.
    run_out = torch.zeros(2, 5, HQ, D)
    run_lse = torch.full((2, HQ, 5), float("-inf"))
    ring_messages.merge(run_out, run_lse, out, lse, slice(0, 5))
    assert run_out.isfinite().all() and bool((run_lse[:, :, 1] == float("-inf")).all())
    grads = KERNELS["math"].backward(torch.ones_like(out), q, k, v, out, lse, SCALE, False, mask)
    assert all(gr.isfinite().all() for gr in grads)


@pytest.mark.parametrize("dv", [D, 8])
def test_attention_core_applies_the_document_mask(dv):
    g = torch.Generator().manual_seed(dv)
    ids = edge_case_ids()
    q, k, v = (torch.randn(B, S, h, d, generator=g) for h, d in ((HQ, D), (HKV, D), (HKV, dv)))
    core = AttentionCore(SCALE, causal=True)
    ref, _ = masked_attention(q, k, v, visible(ids, causal=True))
    torch.testing.assert_close(core(q, k, v, ids), ref, rtol=1e-5, atol=1e-5)
    # None: the plain causal path, bit for bit what it was.
    plain = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=SCALE, enable_gqa=True
    ).transpose(1, 2)
    assert torch.equal(core(q, k, v), plain)


def test_cpu_flash_cannot_take_a_document_mask(capsys, monkeypatch):
    assert resolve_kernel("auto", torch.device("cpu"), D, D, masked=True).name == "math"
    assert resolve_kernel("auto", torch.device("cpu"), D, D).name == "cpu_flash"
    with pytest.raises(ValueError, match="cpu_flash cannot apply document masks"):
        resolve_kernel("cpu_flash", torch.device("cpu"), D, D, masked=True)
    # CUDA: flex for masks, SDPA's flash op in half precision with one head dim, else the
    # memory-efficient op (fp32, or MLA's 192/128 head dims).
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    pick = {
        (True, bf16, D): "flex",
        (False, bf16, D): "sdpa_flash",
        (False, torch.float32, D): "sdpa_efficient",
        (False, bf16, D // 2): "sdpa_efficient",
    }
    for (masked, dtype, dv), name in pick.items():
        assert resolve_kernel("auto", cuda, D, dv, masked, dtype).name == name
    with pytest.raises(ValueError, match="sdpa_flash cannot apply document masks or windows"):
        resolve_kernel("sdpa_flash", cuda, D, D, True, bf16)
    with pytest.raises(ValueError, match="sdpa_cudnn needs bf16/fp16"):
        resolve_kernel("sdpa_cudnn", cuda, D, D, False, torch.float32)
    with pytest.raises(ValueError, match="flex runs on CUDA only"):
        resolve_kernel("flex", torch.device("cpu"), D, D, True)
    from moetrain import train

    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--config=configs/debug_qwen3_moe.toml", "--data.document_mask=true"]
    assert train.main([*argv, "--parallel.cp=2", "--parallel.cp_kernel=cpu_flash"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "cpu_flash cannot apply document masks" in err, err
    assert train.main([*argv, "--parallel.cp=2", "--parallel.cp_kernel=sdpa_flash"]) == 2
    err = capsys.readouterr().err
    assert "sdpa_flash cannot apply document masks" in err, err
    # The kernel against the run's device and precision (setup, before any process group).
    cfg = load_config([f"--config={ROOT / 'configs/debug_qwen3_moe.toml'}"])
    with pytest.raises(
        LayoutError, match="cp_kernel=flex runs on CUDA only, but training runs on cpu"
    ):
        check_cp_kernel("flex", "cpu", cfg)
    with pytest.raises(LayoutError, match="sdpa_flash computes in bf16 only"):
        check_cp_kernel("sdpa_flash", "cuda", cfg)  # the debug config says fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_ids_ride_in_the_kv_message_bit_exact(dtype):
    k, v = torch.randn(2, 5, 3, 4).to(dtype), torch.randn(2, 5, 3, 3).to(dtype)
    ids = torch.randint(0, 2**40, (2, 5))  # beyond any float's exact integers
    buf = ring_messages.pack(k, v, ids)
    assert all(map(torch.equal, ring_messages.unpack(buf, k.shape, v.shape), (k, v)))
    assert torch.equal(ring_messages.unpack_ids(buf, k.shape, v.shape, ids), ids)


def test_reset_positions_restart_after_each_eos():
    eos = 9
    tokens = torch.tensor([1, 2, eos, 3, eos, eos, 4, 5, 6, eos, 7, 8, 1])
    sample = PackedDataset(tokens, seq_len=12, eos_id=eos, reset_positions=True)[0]
    assert sample.document_ids.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4]
    assert sample.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]
    plain = PackedDataset(tokens, seq_len=12, eos_id=eos)[0]
    assert plain.position_ids.tolist() == list(range(12))
    # Batched ids too, and a sample that starts inside a document starts at 0.
    ids = torch.tensor([[3, 3, 4], [0, 1, 1]])
    assert document_positions(ids).tolist() == [[0, 1, 0], [0, 0, 1]]


# --- transformers on each document alone ---------------------------------------------------

# family -> the case of its table (tests/families/) that transformers builds
HF_CASES = {"qwen3_moe": "topk_norm", "deepseek_v3": "qlora_group4", "olmoe": "gqa_clip_bias"}


@pytest.mark.parametrize("family", sorted(HF_CASES))
def test_packed_sample_equals_documents_run_alone_in_transformers(family, tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    table = FAMILIES[family]
    hf_model = tiny_hf_model(transformers, table, HF_CASES[family])
    hf_model.save_pretrained(tmp_path / "hf")
    ours = ours_from_dir(table, tmp_path / "hf")
    eos = hf_model.config.vocab_size - 1
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, eos, (n,), generator=g) for n in (6, 1, 11, 3, 8)]
    stream = torch.cat([torch.cat([d, torch.tensor([eos])]) for d in docs])
    sample = PackedDataset(stream, len(stream) - 1, eos, reset_positions=True)[0]
    ids, doc_ids, pos = sample.input_ids, sample.document_ids, sample.position_ids
    with torch.no_grad():
        logits = ours(ids[None], pos[None], document_ids=doc_ids[None]).logits[0]
        alone = torch.cat(
            [hf_model(ids[doc_ids == d][None]).logits[0] for d in doc_ids.unique().tolist()]
        )
        unmasked = ours(ids[None]).logits[0]
    torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)
    assert (unmasked - alone).abs().max() > 1e-2  # without the mask, documents mix
