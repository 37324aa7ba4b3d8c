"""Prepared shards are verified as they are read: a flipped byte or an id beyond the model's
vocabulary is refused, by shard and offset, before its sample reaches the model."""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest

from moetrain.data.shards import ShardedTokens, read_manifest
from moetrain.errors import DataError
from moetrain.prepare.cli import main as prepare
from tests.distributed import finish, launch_train
from tests.test_tokens_source import BLOCK, DOCS, write_jsonl, write_shards_by_hand


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(data)


def test_a_flipped_byte_is_refused_in_its_block_only(tmp_path):
    directory = write_shards_by_hand(tmp_path / "p", [DOCS[:30], DOCS[30:]])
    manifest = read_manifest(str(directory))
    whole = ShardedTokens(str(directory), manifest)[:]
    first = manifest.shards[0].tokens
    _flip(directory / "shard-00001.tokens", 3 * BLOCK + 5)  # block 3 of shard 1
    stream = ShardedTokens(str(directory), manifest)
    bad = first + (3 * BLOCK + 5) // 2  # the token holding that byte
    # Everything outside the damaged block reads, and equals what was written.
    assert np.array_equal(stream[: first + 3 * BLOCK // 2], whole[: first + 3 * BLOCK // 2])
    after = first + 4 * BLOCK // 2
    assert np.array_equal(stream[after : after + 100], whole[after : after + 100])
    for window in (slice(bad, bad + 1), slice(bad - 40, bad + 40), slice(0, len(whole))):
        with pytest.raises(DataError) as err:
            stream[window]
        message = str(err.value)
        assert "shard-00001.tokens is damaged" in message
        assert f"bytes {3 * BLOCK}-{4 * BLOCK - 1} do not match their CRC-32" in message
        assert "--verify" in message and "not trained on" in message


def test_an_id_beyond_the_vocabulary_is_refused(tmp_path):
    def poison(flat):
        flat = flat.copy()
        flat[77] = 300  # a valid uint16, written with a correct CRC: only the id check sees it
        return flat

    directory = write_shards_by_hand(tmp_path / "p", [DOCS[:30]], edit=poison)
    manifest = read_manifest(str(directory))
    assert len(ShardedTokens(str(directory), manifest)[:]) > 77  # no vocabulary given: read
    stream = ShardedTokens(str(directory), manifest, vocab_size=257)
    assert len(stream[:77]) == 77
    with pytest.raises(DataError, match=r"its token 77 \(byte 154\) is id 300, not below "):
        stream[70:90]


def test_the_refusal_names_the_command_that_repairs_it(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c" / "a.jsonl", DOCS * 40)
    out = tmp_path / "prepared"
    args = ["--source", "jsonl", "--path", str(tmp_path / "c" / "*.jsonl"), "--out", str(out)]
    assert prepare([*args, "--shard-mb", "0.02"]) == 0
    capsys.readouterr()
    _flip(out / "shard-00000.tokens", 100)
    manifest = read_manifest(str(out))
    with pytest.raises(DataError) as err:
        ShardedTokens(str(out), manifest)[0:10]
    command = re.search(r"redoes only damaged shards: (.*)$", str(err.value)).group(1)
    assert command.startswith("python -m moetrain.prepare --source jsonl --path")
    assert str(corpus.parent) in command and f"--out {out}" in command
    # That command, run again, repairs the shard (its done marker no longer matches it).
    assert prepare(shlex.split(command)[3:]) == 0
    assert "1 shards reused" not in capsys.readouterr().out
    repaired = ShardedTokens(str(out), read_manifest(str(out)))
    assert len(repaired[:]) == manifest.num_tokens


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_byte", "id_beyond_vocab"])
def test_damaged_shards_are_refused_through_train_py_on_2_ranks(damage, tmp_path):
    docs = DOCS * 4
    if damage == "flipped_byte":
        directory = write_shards_by_hand(tmp_path / "p", [docs[:120], docs[120:]])
        for shard in directory.glob("*.tokens"):  # one byte in every block: any read fails
            for offset in range(7, shard.stat().st_size, BLOCK):
                _flip(shard, offset)
        expected = "do not match their CRC-32"
        damaged = "is damaged"
    else:
        ids = lambda flat: np.where(flat == ord("m"), 400, flat)  # noqa: E731 (debug vocab: 320)
        directory = write_shards_by_hand(tmp_path / "p", [docs[:120], docs[120:]], edit=ids)
        expected = "not below model.vocab_size=320"
        damaged = "prepare the corpus again"
    out_dir = tmp_path / "run"
    argv = ["--config=configs/debug_qwen3_moe.toml", "--train.steps=2", "--data.source=tokens"]
    argv += [f"--data.path={directory}", "--data.seq_len=64", "--metrics.log_interval=1"]
    proc = launch_train(argv, out_dir, nproc=2)
    log = finish(proc, out_dir, timeout=300)
    assert proc.returncode != 0
    assert damaged in log and expected in log, log[-3000:]
    assert "exitcode  : 2" in log or "exit code 2" in log or "exitcode: 2" in log, log[-3000:]
    # No training step ran: nothing was logged.
    metrics = out_dir / "metrics.jsonl"
    assert not metrics.exists() or not [json.loads(x) for x in metrics.read_text().splitlines()]
