"""data.source=tokens: prepared shards read by memory map give the in-memory sources'
samples; the table-free shuffle; refusals of bad prepared data, before any set-up."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain import train
from moetrain.config import DataSection
from moetrain.data.corpus import check_corpus
from moetrain.data.packing import pack_corpus
from moetrain.data.permutation import FeistelPermutation
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.shards import (
    MANIFEST,
    Manifest,
    ShardedTokens,
    ShardInfo,
    TokenizerId,
    file_sha256,
    read_manifest,
)
from moetrain.data.tokenizers import ByteTokenizer
from moetrain.errors import DataError
from moetrain.prepare.cli import main as prepare
from tests.corpus import build_dataset
from tests.distributed import ROOT, run_train

EOS = ByteTokenizer.eos_id
DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(60)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


BLOCK = 64  # a tiny block, so that a small corpus has many


def write_shards_by_hand(
    out: Path, docs_per_shard: list[list[str]], edit=lambda flat: flat, command: str = ""
) -> Path:
    """An independent writer of the format (no moetrain.prepare): one shard per doc list,
    each block's CRC-32 taken whole with zlib. `edit` may change the ids before writing."""
    out.mkdir(parents=True)
    shards = []
    for i, docs in enumerate(docs_per_shard):
        flat, n_docs, _ = pack_corpus(docs, ByteTokenizer())
        ends = (np.flatnonzero(flat == EOS) + 1).astype("<u8")
        name = f"shard-{i:05d}"
        data = edit(flat).astype("<u2").tobytes()
        (out / f"{name}.tokens").write_bytes(data)
        ends.tofile(out / f"{name}.docs")
        crcs = [zlib.crc32(data[a : a + BLOCK]) for a in range(0, len(data), BLOCK)]
        np.asarray(crcs, dtype="<u4").tofile(out / f"{name}.crc")
        shards.append(
            ShardInfo(
                name,
                len(flat),
                n_docs,
                *(file_sha256(str(out / f"{name}{s}")) for s in (".tokens", ".docs", ".crc")),
            )
        )
    tok = TokenizerId("byte", None, 257, EOS)
    manifest = Manifest(tok, "<u2", shards, block_bytes=BLOCK, command=command)
    (out / MANIFEST).write_text(manifest.to_json())
    return out


def test_sharded_stream_is_the_concatenation_across_shard_boundaries(tmp_path):
    parts = [DOCS[:7], DOCS[7:8], DOCS[8:30], DOCS[30:]]
    directory = write_shards_by_hand(tmp_path / "p", parts)
    stream = ShardedTokens(str(directory), read_manifest(str(directory)))
    whole = pack_corpus(DOCS, ByteTokenizer())[0]
    assert len(stream) == len(whole)
    assert np.array_equal(stream[:], whole)
    rng = np.random.default_rng(0)
    for _ in range(200):  # random windows, many of which straddle one or more boundaries
        a = int(rng.integers(0, len(whole)))
        b = int(rng.integers(a, min(len(whole), a + 400) + 1))
        assert np.array_equal(stream[a:b], whole[a:b])
    capped = ShardedTokens(str(directory), read_manifest(str(directory)), limit=100)
    assert len(capped) == 100 and np.array_equal(capped[90:200], whole[90:100])


def test_tokens_source_gives_the_in_memory_samples(tmp_path):
    directory = write_shards_by_hand(tmp_path / "p", [DOCS[:25], DOCS[25:]])
    corpus = write_jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    for max_tokens in (None, 1500):
        tokens = build_dataset(
            DataSection(source="tokens", path=str(directory), seq_len=16, max_tokens=max_tokens),
            ByteTokenizer(),
        )
        memory = build_dataset(
            DataSection(source="jsonl", path=str(corpus), seq_len=16, max_tokens=max_tokens),
            ByteTokenizer(),
        )
        assert len(tokens) == len(memory) > 10
        for i in range(len(memory)):
            for key in ("input_ids", "labels", "position_ids", "document_ids"):
                assert torch.equal(getattr(tokens[i], key), getattr(memory[i], key)), (i, key)
        assert tokens.summary.documents == 60 and tokens.summary.truncated == bool(max_tokens)
        line = tokens.summary.describe(16, len(tokens))
        assert "60 documents" in line and f"{len(tokens)} samples" in line
        assert ("data.max_tokens cut the corpus" in line) == bool(max_tokens)
        assert memory.summary.truncated == bool(max_tokens)


def test_feistel_permutation_is_a_seeded_bijection():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        order = FeistelPermutation(n, b"0:0").all()
        assert sorted(order.tolist()) == list(range(n))
    a, b = FeistelPermutation(1000, b"0:0").all(), FeistelPermutation(1000, b"0:1").all()
    assert (a != b).mean() > 0.9 and not np.array_equal(a, np.arange(1000))
    assert np.array_equal(a, FeistelPermutation(1000, b"0:0").all())
    big = FeistelPermutation(10**12, b"7:3")  # no table: a trillion samples cost nothing
    assert len({big[i] for i in range(1000)}) == 1000
    assert all(0 <= big[i] < 10**12 for i in range(1000))


def test_sampler_shuffles_without_a_table():
    sampler = GlobalBatchSampler(10**11, 8, 2, 0, 1, seed=5)
    batch = sampler.next_micro_batch()
    assert len(batch) == 2 and all(0 <= i < 10**11 for i in batch)
    assert sampler.sample_at(0) == GlobalBatchSampler(10**11, 8, 2, 1, 4, seed=5).sample_at(0)


# --- refusals --------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path):
    return write_shards_by_hand(tmp_path / "prepared", [DOCS[:30], DOCS[30:]])


def _hf_tokenizer(path: Path) -> str:
    from tests.test_data import _save_tiny_hf_tokenizer

    return str(_save_tiny_hf_tokenizer(path, ["</s>"]))


def test_another_tokenizer_than_the_prepared_one_is_refused(prepared, tmp_path):
    pytest.importorskip("tokenizers")
    from moetrain.data.tokenizers import HFTokenizer

    tok = _hf_tokenizer(tmp_path / "tok.json")
    cfg = DataSection(source="tokens", path=str(prepared), tokenizer=tok)
    with pytest.raises(DataError, match=r"prepared with tokenizer byte.*prepare again"):
        check_corpus(cfg, HFTokenizer(tok))


def test_truncated_and_corrupted_shards_are_refused_by_name(prepared):
    cfg = DataSection(source="tokens", path=str(prepared))
    check_corpus(cfg, ByteTokenizer())  # intact
    shard = prepared / "shard-00001.tokens"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(data)
    check_corpus(cfg, ByteTokenizer())  # same size: only a checksum sees it
    with pytest.raises(DataError, match=r"shard-00001\.tokens does not match its checksum"):
        check_corpus(replace(cfg, verify="checksum"), ByteTokenizer())
    shard.write_bytes(data[:-6])
    with pytest.raises(DataError, match=r"shard-00001\.tokens has \d+ bytes but the manifest"):
        check_corpus(cfg, ByteTokenizer())


def test_a_directory_without_manifest_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match=r"has no manifest\.json.*moetrain\.prepare"):
        check_corpus(DataSection(source="tokens", path=str(tmp_path / "half")), ByteTokenizer())


def test_a_large_corpus_is_refused_in_memory_with_the_prepare_command(tmp_path):
    corpus = write_jsonl(tmp_path / "big.jsonl", ["x" * 4096] * 600)  # ~2.4 MB
    cfg = DataSection(source="jsonl", path=str(corpus), max_in_memory_mb=1)
    with pytest.raises(DataError, match=r"above data\.max_in_memory_mb=1.*moetrain\.prepare"):
        check_corpus(cfg, ByteTokenizer())
    check_corpus(replace(cfg, max_tokens=10_000), ByteTokenizer())  # capped: fine


@pytest.fixture
def front_door(monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


DEBUG = "--config=configs/debug_qwen3_moe.toml"


def _refusal(argv: list[str], capsys) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err, err
    return err


def test_bad_data_is_refused_through_train_py(front_door, prepared, tmp_path, capsys):
    # A path the default source would ignore (it would train on the standard library).
    assert "does not read it" in _refusal([DEBUG, "--data.path=x.jsonl"], capsys)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "fine"}\n{"body": "no text", "id": 3}\n')
    err = _refusal([DEBUG, "--data.source=jsonl", f"--data.path={bad_line}"], capsys)
    assert "bad.jsonl:2" in err and "'body', 'id'" in err and "data.text_field" in err
    not_json = tmp_path / "tokenizer.json"
    not_json.write_text("this is not a tokenizer")
    err = _refusal([DEBUG, f"--data.tokenizer={not_json}"], capsys)
    assert "tokenizer.json" in err and "not a valid tokenizer.json" in err
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    err = _refusal([DEBUG, "--data.source=jsonl", f"--data.path={empty}"], capsys)
    assert "the corpus is empty" in err
    os.remove(prepared / "shard-00000.docs")
    err = _refusal([DEBUG, "--data.source=tokens", f"--data.path={prepared}"], capsys)
    assert "shard-00000.docs is missing" in err


# --- through train.py -------------------------------------------------------------------

SMALL = [
    DEBUG,
    "--train.steps=4",
    "--train.warmup_steps=2",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=2",
    "--data.seq_len=64",
    "--metrics.log_interval=1",
]


@pytest.fixture
def corpus_and_prepared(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "moe", "expert", "token", "shard", "ring"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(5, 120)))) for _ in range(400)]
    corpus = write_jsonl(tmp_path / "corpus" / "part-0.jsonl", docs[:250])
    write_jsonl(tmp_path / "corpus" / "part-1.jsonl", docs[250:])
    out = tmp_path / "prepared"
    argv = ["--source", "jsonl", "--path", str(corpus.parent / "*.jsonl"), "--out", str(out)]
    assert prepare([*argv, "--workers", "2", "--shard-mb", "0.01"]) == 0
    assert len(read_manifest(str(out)).shards) > 2
    return corpus.parent, out


@pytest.mark.slow
def test_prepared_shards_train_like_the_jsonl_corpus(corpus_and_prepared, tmp_path):
    corpus, prepared = corpus_and_prepared
    jsonl = ["--data.source=jsonl", f"--data.path={corpus}/*.jsonl"]
    tokens = ["--data.source=tokens", f"--data.path={prepared}"]
    ref = run_train(SMALL + jsonl, tmp_path / "jsonl")
    for nproc in (1, 2):
        ours = run_train(SMALL + tokens, tmp_path / f"tokens{nproc}", nproc=nproc)
        assert [r["data_fingerprint"] for r in ours] == [r["data_fingerprint"] for r in ref]
        assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    log = (tmp_path / "tokens2.log").read_text()
    assert "data: tokens" in log and "documents" in log and "samples of 64 tokens" in log


@pytest.mark.slow
def test_reshard_resume_from_prepared_shards(corpus_and_prepared, tmp_path):
    """2 ranks for 4 steps vs resuming its step-2 checkpoint on 4 ranks with ep=2."""
    _, prepared = corpus_and_prepared
    argv = SMALL + ["--data.source=tokens", f"--data.path={prepared}", "--checkpoint.interval=2"]
    full = run_train(argv, tmp_path / "full", nproc=2)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2"
    )
    resumed = run_train(argv + ["--parallel.ep=2"], resumed_dir, nproc=4)
    tail = [r for r in resumed if r["step"] > 2]
    assert [r["step"] for r in tail] == [3, 4]
    assert [r["data_fingerprint"] for r in tail] == [r["data_fingerprint"] for r in full[2:]]
    assert [r["loss"] for r in tail] == pytest.approx([r["loss"] for r in full[2:]], rel=1e-5)
