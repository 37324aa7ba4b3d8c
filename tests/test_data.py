"""Tests of moetrain/data/: tokenizers, sources, packing, global sample order and resume."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config import DataSection, TrainSection
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.data.loader import build_dataloader
from moetrain.data.packing import PackedDataset
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.sources import iter_documents, stdlib_files
from moetrain.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer
from moetrain.errors import DataError
from moetrain.parallelisms.dims import LayoutError, grad_accum_steps
from tests.corpus import build_dataset, pack_documents

EOS = ByteTokenizer.eos_id
SAMPLER_KEY = "_index_sampler_state"  # where StatefulDataLoader keeps the batch sampler's state


def stdlib_cfg(**kw) -> DataSection:
    kw.setdefault("max_tokens", 4000)
    kw.setdefault("seq_len", 16)
    return DataSection(source="stdlib", **kw)


def take(it, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = vars(x), vars(y)  # field name -> tensor (None where absent)
        assert x.keys() == y.keys()
        for key in x:
            assert (x[key] is None and y[key] is None) or torch.equal(x[key], y[key]), key


def global_steps(num_samples, G, micro, dp, steps, seed=0, shuffle=True) -> list[list[int]]:
    """Per step: the concatenation of every rank's micro-batches, rank 0 first."""
    samplers = [GlobalBatchSampler(num_samples, G, micro, r, dp, seed, shuffle) for r in range(dp)]
    iters = [iter(s) for s in samplers]
    accum = grad_accum_steps(G, micro, dp)
    out = []
    for _ in range(steps):
        step = []
        for it in iters:
            for _ in range(accum):
                step += next(it)
        out.append(step)
    return out


# --- tokenizers ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_eos():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256
    text = "héllo wörld ✓\n"
    ids = tok.encode(text)
    assert list(ids) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(list(ids) + [EOS]) == text  # EOS is not a byte
    packed = pack_documents(["ab", "", "c"], tok)  # the empty document is dropped
    assert packed.tolist() == [97, 98, EOS, 99, EOS]
    assert IGNORE_INDEX == -100


def _save_tiny_hf_tokenizer(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *specials])
    tok.train_from_iterator(["the cat sat", "the dog ran", "a cat ran"], trainer=trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_loads_encodes_and_finds_eos(tmp_path):
    from tokenizers import Tokenizer

    path = _save_tiny_hf_tokenizer(tmp_path / "tokenizer.json", ["</s>"])
    tok = build_tokenizer(DataSection(tokenizer=str(path)))
    assert isinstance(tok, HFTokenizer)
    raw = Tokenizer.from_file(str(path))
    assert tok.eos_id == raw.token_to_id("</s>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 8
    ids = tok.encode("the cat ran")
    assert ids == [raw.token_to_id(w) for w in ("the", "cat", "ran")]
    assert tok.decode(ids) == "the cat ran"
    # A model directory holding tokenizer.json works too, and an explicit eos_token wins.
    assert HFTokenizer(tmp_path, eos_token="<unk>").eos_id == raw.token_to_id("<unk>")
    # Packing with it puts its EOS after each document.
    packed = pack_documents(["the cat", "a dog"], tok).tolist()
    assert packed[2] == tok.eos_id and packed[-1] == tok.eos_id and len(packed) == 6


def test_hf_tokenizer_eos_errors(tmp_path):
    path = _save_tiny_hf_tokenizer(tmp_path / "tok.json", ["<pad>"])
    with pytest.raises(DataError, match="data.eos_token"):
        HFTokenizer(path)
    with pytest.raises(DataError, match="data.eos_token='<nope>'"):
        HFTokenizer(path, eos_token="<nope>")
    with pytest.raises(DataError, match="data.tokenizer"):
        build_tokenizer(DataSection(tokenizer=str(tmp_path / "missing.json")))


# --- sources -----------------------------------------------------------------------------------


def test_stdlib_source_is_real_text_and_deterministic():
    files = stdlib_files()
    assert len(files) > 100
    root = Path(os.__file__).resolve().parent
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    assert not any(
        {"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files
    )
    a = build_dataset(stdlib_cfg(max_tokens=50_000), ByteTokenizer())
    b = build_dataset(stdlib_cfg(max_tokens=50_000), ByteTokenizer())
    tokens = a.tokens[:]  # the in-memory stream, with its document index
    assert len(tokens) == 50_000 and np.array_equal(tokens, b.tokens[:])
    text = ByteTokenizer().decode(tokens)
    assert "import " in text and "def " in text
    assert (tokens == EOS).sum() >= 1  # several files fit in 50k tokens
    assert a.tokens.ends_within(0, 50_000).tolist() == (np.flatnonzero(tokens == EOS) + 1).tolist()


def test_text_glob_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "skip.md").write_text("not matched")
    docs = list(iter_documents(DataSection(source="text", path=str(tmp_path / "**" / "*.txt"))))
    assert docs == ["first", "second", "third"]  # sorted paths, ** is recursive


def test_jsonl_source_and_missing_field(tmp_path):
    (tmp_path / "1.jsonl").write_text(
        json.dumps({"text": "alpha", "id": 1}) + "\n\n" + json.dumps({"text": "beta"}) + "\n"
    )
    (tmp_path / "2.jsonl").write_text(json.dumps({"body": "gamma", "text": "delta"}) + "\n")
    cfg = DataSection(source="jsonl", path=str(tmp_path / "*.jsonl"))
    assert list(iter_documents(cfg)) == ["alpha", "beta", "delta"]
    cfg.text_field = "body"
    with pytest.raises(DataError, match=r"1\.jsonl:1: no field 'body'"):
        list(iter_documents(cfg))


@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_missing_path_errors_name_data_path(tmp_path, source):
    pattern = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(DataError, match=r"data\.path=.*matched no files"):
        iter_documents(DataSection(source=source, path=pattern))
    with pytest.raises(DataError, match=r"data\.path"):
        iter_documents(DataSection(source=source, path=None))


def test_hf_datasets_source_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": ["one", "two", "three"]}).save_to_disk(tmp_path / "ds")
    cfg = DataSection(source="hf_datasets", path=str(tmp_path / "ds"), text_field="content")
    assert list(iter_documents(cfg)) == ["one", "two", "three"]
    cfg.text_field = "text"
    with pytest.raises(DataError, match="no 'text'"):
        iter_documents(cfg)
    with pytest.raises(DataError, match=r"data\.path"):
        iter_documents(DataSection(source="hf_datasets", path=str(tmp_path / "absent")))


# --- packing -----------------------------------------------------------------------------------


def test_packing_separators_labels_and_document_ids():
    docs = ["abcde", "fg", "hijklmnopq", "rs"]
    tokens = pack_documents(docs, ByteTokenizer())
    assert tokens.dtype == torch.int32
    assert ByteTokenizer().decode(tokens) == "".join(docs)
    assert (tokens == EOS).nonzero().flatten().tolist() == [5, 8, 19, 22]
    ds = PackedDataset(tokens, seq_len=4, eos_id=EOS)
    assert len(ds) == (23 - 1) // 4
    for i in range(len(ds)):
        s = ds[i]
        for key in ("input_ids", "labels", "position_ids", "document_ids"):
            assert getattr(s, key).shape == (4,) and getattr(s, key).dtype == torch.int64
        chunk = tokens[i * 4 : i * 4 + 5].long()
        assert torch.equal(s.input_ids, chunk[:-1]) and torch.equal(s.labels, chunk[1:])
        assert s.position_ids.tolist() == [0, 1, 2, 3]
    # Sample 1 holds tokens 4..7 = "e", EOS, "f", "g": the document changes after the EOS.
    assert ds[1].input_ids.tolist() == [ord("e"), EOS, ord("f"), ord("g")]
    assert ds[1].document_ids.tolist() == [0, 0, 1, 1]
    assert ds[0].document_ids.tolist() == [0, 0, 0, 0]


def test_max_tokens_and_too_few_tokens():
    assert pack_documents(["abcdef", "ghi"], ByteTokenizer(), max_tokens=4).tolist() == list(
        b"abcd"
    )
    with pytest.raises(DataError, match=r"gave 10 tokens.*data\.seq_len=16 needs at least 17"):
        build_dataset(stdlib_cfg(max_tokens=10), ByteTokenizer())


# --- global sample order -------------------------------------------------------------------------


def test_order_is_seeded():
    a = global_steps(100, 8, 2, 1, steps=5, seed=1)
    assert a == global_steps(100, 8, 2, 1, steps=5, seed=1)
    assert a != global_steps(100, 8, 2, 1, steps=5, seed=2)
    assert global_steps(100, 8, 2, 1, steps=2, shuffle=False) == [
        list(range(8)),
        list(range(8, 16)),
    ]


def test_epoch_boundary_starts_a_new_permutation():
    n = 10
    steps = global_steps(n, 4, 1, 1, steps=5, seed=3)  # 20 positions = two full epochs
    stream = [i for step in steps for i in step]
    epoch0, epoch1 = stream[:n], stream[n:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1
    sampler = GlobalBatchSampler(n, 4, 1, 0, 1, seed=3)
    assert epoch1 == [sampler.sample_at(n + i) for i in range(n)]  # epoch 1's positions


def test_sharding_is_layout_independent():
    n, G = 50, 8
    reference = global_steps(n, G, 1, 1, steps=9)  # crosses an epoch boundary
    for dp in (1, 2, 4):
        for micro in (1, 2):
            if G % (micro * dp):
                continue
            assert global_steps(n, G, micro, dp, steps=9) == reference
            # Within a step, ranks read disjoint positions.
            samplers = [GlobalBatchSampler(n, G, micro, r, dp, 0) for r in range(dp)]
            accum = grad_accum_steps(G, micro, dp)
            per_rank = [{i for _ in range(accum) for i in next(iter(s))} for s in samplers]
            assert sum(len(p) for p in per_rank) == G
            assert set().union(*per_rank) == set(reference[0])


def test_batch_size_validation():
    assert grad_accum_steps(8, 2, 2) == 2
    with pytest.raises(LayoutError, match="multiple of train.micro_batch_size"):
        grad_accum_steps(8, 3, 1)
    with pytest.raises(LayoutError, match="divisible"):
        GlobalBatchSampler(100, 8, 1, 0, 3, seed=0)
    with pytest.raises(LayoutError, match="global_batch_size=6"):
        build_dataloader(stdlib_cfg(), TrainSection(global_batch_size=6), dp_rank=0, dp_size=4)


def test_sampler_state_is_layout_independent_at_step_boundaries():
    states = []
    for dp in (1, 2, 4):
        for rank in range(dp):
            s = GlobalBatchSampler(100, 8, 1, rank, dp, seed=5)
            it = iter(s)
            for _ in range(2 * grad_accum_steps(8, 1, dp)):
                next(it)
            states.append(s.state_dict())
    assert all(st == states[0] for st in states)
    assert states[0]["consumed_samples"] == 16 and states[0]["micro_batches_into_step"] == 0

    # Mid-step, only the same layout may load the state.
    s = GlobalBatchSampler(100, 8, 1, 0, 2, seed=5)
    next(iter(s))
    mid = s.state_dict()
    GlobalBatchSampler(100, 8, 1, 1, 2, seed=5).load_state_dict(mid)  # other rank: fine
    with pytest.raises(DataError, match="mid-step"):
        GlobalBatchSampler(100, 8, 1, 0, 4, seed=5).load_state_dict(mid)
    with pytest.raises(DataError, match="seed"):
        GlobalBatchSampler(100, 8, 1, 0, 2, seed=6).load_state_dict(mid)


# --- StatefulDataLoader resume -------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_resume_mid_epoch(num_workers):
    data = stdlib_cfg(num_workers=num_workers)  # 249 samples
    train = TrainSection(global_batch_size=8, micro_batch_size=2, seed=7)  # 4 micro per step
    loader, tok = build_dataloader(data, train, dp_rank=0, dp_size=1)
    it = iter(loader)
    first = take(it, 7)  # 1 step + 3 micro-batches: mid-step
    assert first[0].input_ids.shape == (2, 16)
    saved = loader.state_dict()
    expected = take(it, 140)  # runs past the end of epoch 0 (249 samples = 124.5 batches)
    del it

    fresh, _ = build_dataloader(data, train, dp_rank=0, dp_size=1, tokenizer=tok)
    fresh.load_state_dict(saved)
    it2 = iter(fresh)
    if num_workers == 0:
        # The sampler state was restored, not replaced by an islice fast-forward.
        assert fresh.batch_sampler.state_dict() == saved[SAMPLER_KEY]
        assert saved[SAMPLER_KEY]["consumed_samples"] == 8
        assert saved[SAMPLER_KEY]["micro_batches_into_step"] == 3
    else:
        sampler_state = saved["_snapshot"]["_main_snapshot"][SAMPLER_KEY]
        assert (sampler_state["consumed_samples"], sampler_state["micro_batches_into_step"]) == (
            8,
            3,
        )
    assert_same_batches(take(it2, 140), expected)


def test_loader_resume_on_another_dp_size_at_step_boundary():
    data = stdlib_cfg()
    train = TrainSection(global_batch_size=8, micro_batch_size=2, seed=11)
    loader, tok = build_dataloader(data, train, dp_rank=0, dp_size=1)
    it = iter(loader)
    take(it, 3 * 4)  # three full steps
    saved = loader.state_dict()
    reference = take(it, 2 * 4)  # the next two steps on one rank
    reference_state = loader.state_dict()[SAMPLER_KEY]
    ref_steps = [torch.cat([b.input_ids for b in reference[s * 4 : s * 4 + 4]]) for s in (0, 1)]

    for dp in (2, 4):
        micro = 2 if dp == 2 else 1
        train_dp = TrainSection(global_batch_size=8, micro_batch_size=micro, seed=11)
        accum = grad_accum_steps(8, micro, dp)
        rank_batches, rank_states = [], []
        for rank in range(dp):
            rank_loader, _ = build_dataloader(data, train_dp, rank, dp, tokenizer=tok)
            rank_loader.load_state_dict(saved)
            # At a step boundary the sampler state is the same whatever the layout.
            assert rank_loader.state_dict()[SAMPLER_KEY] == saved[SAMPLER_KEY]
            rank_batches.append(take(iter(rank_loader), 2 * accum))
            rank_states.append(rank_loader.state_dict()[SAMPLER_KEY])
        assert all(st == reference_state for st in rank_states)
        for s in (0, 1):
            step = [b.input_ids for rb in rank_batches for b in rb[s * accum : (s + 1) * accum]]
            assert torch.equal(torch.cat(step), ref_steps[s])


def test_hf_datasets_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="pip install datasets"):
        iter_documents(DataSection(source="hf_datasets", path="anything"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_at_a_step_boundary_resumes_with_any_workers(num_workers):
    """What a checkpoint saves (`state_at(steps * G)`, not the loader's own state, which
    workers' prefetch has moved on) continues the stream exactly, even into a loader with
    another number of workers."""
    train = TrainSection(global_batch_size=8, micro_batch_size=2, seed=3)  # 4 micro per step
    loader, tok = build_dataloader(stdlib_cfg(num_workers=num_workers), train)
    it = iter(loader)
    take(it, 3 * 4)  # three steps; with workers the sampler has run ahead by now
    state = loader.batch_sampler.state_at(3 * 8)
    expected = take(it, 2 * 4)
    del it
    for workers in (0, 2):
        fresh, _ = build_dataloader(stdlib_cfg(num_workers=workers), train, tokenizer=tok)
        fresh.batch_sampler.load_state_dict(state)
        assert_same_batches(take(iter(fresh), 2 * 4), expected)
