"""The data path's one reader of prepared directories (moetrain/data/prepared.py): a run
reads each manifest once, from the preflight to the loader; the hold-out hash is the
formula docs/data.md states; a checkpoint made under the old hash is refused by name."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import pytest

import moetrain.data.prepared as prepared
from moetrain.checkpoint.resume import accept_checkpoint
from moetrain.config import load_config
from moetrain.data.holdout import HOLDOUT_HASH, held_out
from moetrain.data.loader import build_dataloader
from moetrain.data.run_data import build_data
from moetrain.data.tokenizers import build_tokenizer
from moetrain.errors import DataError
from moetrain.models import get_model_spec
from moetrain.parallelisms.dims import ParallelDims
from moetrain.prepare.cli import main as prepare
from tests.distributed import ROOT
from tests.test_tokens_source import write_jsonl

MASK64 = (1 << 64) - 1


def _splitmix64(d: int) -> int:
    """docs/data.md's formula, in Python integers (no numpy): the reference."""
    z = (d + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@pytest.mark.parametrize("fraction", [0.013, 0.1, 0.5, 0.9])
def test_the_hold_out_is_the_documented_formula(fraction):
    threshold = min(int(fraction * 2.0**64), MASK64)
    docs = np.arange(3000)
    want = np.array([_splitmix64(int(d)) < threshold for d in docs])
    assert np.array_equal(held_out(docs, fraction), want)
    # SplitMix64's published first output for seed 0, and document 0 is no longer held
    # out at every fraction (the old hash's was 0).
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert bool(held_out(np.array([0]), fraction)[0]) == (fraction > 0xE220A8397B1DCDAF / 2**64)


def test_the_docs_state_the_hash_the_code_uses():
    page = (ROOT / "docs" / "data.md").read_text()
    for constant in ("0x9E3779B97F4A7C15", "0xBF58476D1CE4E5B9", "0x94D049BB133111EB"):
        assert constant in page
    assert "Held-out documents" in page and HOLDOUT_HASH in page


def _prepare(directory: Path, seed: int) -> str:
    docs = [f"corpus {seed} document {i}: " + "lorem ipsum " * (i % 7 + 3) for i in range(120)]
    source = write_jsonl(directory / "src" / "a.jsonl", docs)
    out = directory / "prepared"
    argv = ["--source", "jsonl", "--path", str(source), "--out", str(out), "--workers", "1"]
    assert prepare(argv) == 0
    return str(out)


def test_a_run_reads_each_prepared_manifest_once(tmp_path, monkeypatch):
    a, b, c = (_prepare(tmp_path / name, i) for i, name in enumerate("abc"))
    monkeypatch.chdir(ROOT)
    argv = [
        "--config=configs/debug_qwen3_moe.toml",
        "--data.source=tokens",
        "--data.seq_len=32",
        "--data.max_tokens=none",
        f"--data.mix=[{{path='{a}', weight=2, name='a'}}, {{path='{b}', weight=1, name='b'}}]",
        f"--eval.mix=[{{path='{b}', weight=1, name='b'}}, {{path='{c}', weight=1, name='c'}}]",
        "--eval.samples=4",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=2",
    ]
    cfg = load_config(argv)
    reads = collections.Counter()
    real = prepared.read_manifest

    def counting(path, key="data.path"):
        reads[path] += 1
        return real(path, key)

    monkeypatch.setattr(prepared, "read_manifest", counting)
    from moetrain.loop.preflight import preflight

    corpora = preflight(cfg, ParallelDims.of(cfg.parallel, 1))
    tokenizer = build_tokenizer(cfg.data)
    data = build_data(cfg.data, cfg.eval, tokenizer, cfg.model.args.vocab_size, corpora)
    loader, _ = build_dataloader(cfg.data, cfg.train, 0, 1, tokenizer, data=data)
    next(iter(loader))
    assert [h.name for h in data.held_out] == ["b", "c"] and len(data.sources) == 2
    assert reads == {a: 1, b: 1, c: 1}  # b is a training source and an eval source: once


def test_nothing_but_the_prepared_corpus_reads_a_manifest():
    """The data path's other modules take a PreparedCorpus; `prepare` reads back only what
    it wrote."""
    callers = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "moetrain").rglob("*.py")
        if re.search(r"\bread_manifest\(", p.read_text())
    }
    assert callers == {
        "moetrain/data/shards.py",  # its definition
        "moetrain/data/prepared.py",
        "moetrain/prepare/run.py",
    }


def test_a_checkpoint_of_the_old_hold_out_hash_is_refused_by_name(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(["--config=configs/debug_qwen3_moe.toml", "--eval.fraction=0.1"])
    spec = get_model_spec("qwen3_moe")
    old = {
        "config": {"eval": {"fraction": 0.1}},
        "data": {"micro_batches_into_step": 0},
        "data_identity": {"source": "stdlib", "tokens": 1, "fingerprint": "f"},  # no holdout
    }
    with pytest.raises(DataError, match="old hold-out hash .* held out document 0") as err:
        accept_checkpoint("ckpt/step-5", old, cfg, spec, None)
    assert "--checkpoint.allow_data_change=true" in str(err.value)
    assert "new job.output_dir" in str(err.value)
    cfg.checkpoint.allow_data_change = True  # on purpose: continues, the data marked changed
    assert accept_checkpoint("ckpt/step-5", old, cfg, spec, None) is True
