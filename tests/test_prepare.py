"""Tests of `python -m moetrain.prepare` (moetrain/prepare/run.py, moetrain/prepare/worker.py):
the prepared stream equals the in-memory one, determinism, resume, and the refusals."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import DataSection
from moetrain.data.shards import MANIFEST, ShardedTokens, read_manifest
from moetrain.data.sources import iter_documents
from moetrain.data.tokenizers import build_tokenizer
from moetrain.prepare.cli import main
from moetrain.prepare.work_plan import plan_file_units
from tests.corpus import pack_documents

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "dog", "ran", "a", "héllo", "wörld", "✓", "zebra"]


def _text(rng: np.random.Generator, max_words: int = 40) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(0, max_words))))


def write_jsonl(root: Path, files: int = 3, lines: int = 300, seed: int = 0) -> str:
    """JSON-lines files with the awkward cases: blank lines, empty texts, \\r\\n and lone \\r
    line ends, an invalid UTF-8 byte, extra fields. Returns the pattern."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        out = bytearray()
        for i in range(lines):
            out += json.dumps({"id": i, "text": _text(rng)}, ensure_ascii=i % 2 == 0).encode()
            out += (b"\r\n", b"\r", b"\n\n", b"\n", b"\n", b"\n")[i % 6]
            if i % 50 == 7:  # a raw invalid byte inside a string: read as U+FFFD
                out += b'{"text": "bad \xff byte"}\n   \n'
        (root / f"part-{f}.jsonl").write_bytes(bytes(out))
    return str(root / "*.jsonl")


def write_text(root: Path, files: int = 12, seed: int = 0) -> str:
    """Text files in nested folders (one document each), one empty, one with \\r\\n."""
    rng = np.random.default_rng(seed)
    for f in range(files):
        path = root / f"d{f % 3}" / f"f{f:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "" if f == 4 else "\n".join(_text(rng, 200) for _ in range(int(rng.integers(1, 9))))
        path.write_bytes(body.replace("\n", "\r\n" if f == 5 else "\n").encode() + b"\xfe")
    return str(root / "**" / "*.txt")


def save_tiny_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["the cat sat", "the dog ran", "a cat ran"], trainer=trainer)
    tok.save(str(path))
    return path


def prepare(source: str, path: str, out: Path, *extra: str, workers: int = 2, mb="0.01") -> int:
    argv = ["--source", source, "--path", path, "--out", str(out), "--workers", str(workers)]
    return main([*argv, "--shard-mb", mb, *extra])


def matched(pattern: str) -> list[str]:
    """The files a source glob selects, in order (as moetrain/data/sources.py selects them)."""
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def all_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def in_memory(source: str, path: str, tokenizer: str = "byte", **kw) -> np.ndarray:
    cfg = DataSection(source=source, path=path, tokenizer=tokenizer, **kw)
    return pack_documents(iter_documents(cfg), build_tokenizer(cfg)).numpy()


def check_stream(out: Path, expected: np.ndarray) -> None:
    """The shards concatenate to `expected`; each shard's .docs are its EOS positions + 1."""
    manifest = read_manifest(str(out))
    assert manifest.dtype == "<u2"
    stream = ShardedTokens(str(out), manifest)[:]
    np.testing.assert_array_equal(stream.astype(np.int64), expected)
    eos = manifest.tokenizer.eos_id
    for shard in manifest.shards:
        tokens = np.fromfile(out / f"{shard.name}.tokens", dtype=manifest.dtype)
        ends = np.fromfile(out / f"{shard.name}.docs", dtype="<u8")
        np.testing.assert_array_equal(ends, np.flatnonzero(tokens == eos) + 1)
        assert len(ends) == shard.documents and tokens[-1] == eos  # no document is cut
    assert manifest.num_documents == int((expected == eos).sum())


# --- the prepared stream is the in-memory stream ---------------------------------------------


@pytest.mark.parametrize("source", ["jsonl", "text"])
@pytest.mark.parametrize("tokenizer", ["byte", "tokenizer.json"])
def test_stream_equals_in_memory(tmp_path, capsys, source, tokenizer):
    write = write_jsonl if source == "jsonl" else write_text
    pattern = write(tmp_path / "corpus")
    if tokenizer != "byte":
        tokenizer = str(save_tiny_tokenizer(tmp_path / "tokenizer.json"))
    mb = "0.01" if source == "jsonl" else "0.004"  # several shards either way
    assert prepare(source, pattern, tmp_path / "out", "--tokenizer", tokenizer, mb=mb) == 0
    check_stream(tmp_path / "out", in_memory(source, pattern, tokenizer))
    manifest = read_manifest(str(tmp_path / "out"))
    assert len(manifest.shards) >= 4
    assert manifest.tokenizer.kind == ("byte" if tokenizer == "byte" else "tokenizer.json")
    assert [f["path"] for f in manifest.source["files"]] == list(
        map(os.path.abspath, matched(pattern))
    )
    out, err = capsys.readouterr()
    assert out.startswith("prepared ") and f"{len(manifest.shards)} shards" in out
    # Each corpus has invalid UTF-8 (read as U+FFFD): said once, in one line, not in silence.
    replaced, first = (18, "part-0.jsonl:") if source == "jsonl" else (12, "f00.txt:")
    assert err.startswith(f"note: {replaced} documents held bytes that are not valid UTF-8")
    assert err.count("\n") == 1 and first in err


def test_progress_goes_to_stderr_only_when_asked(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c", files=1, lines=100)
    assert prepare("jsonl", pattern, tmp_path / "out", "--progress") == 0
    out, err = capsys.readouterr()
    assert out.startswith("prepared ") and out.count("\n") == 1
    assert "MB" in err and "docs" in err and "tokens/s" in err and "ETA" in err


def test_hf_datasets_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [_text(np.random.default_rng(i)) for i in range(200)] + [None, ""]
    datasets.Dataset.from_dict({"text": rows, "n": list(range(len(rows)))}).save_to_disk(
        str(tmp_path / "ds")
    )
    assert prepare("hf_datasets", str(tmp_path / "ds"), tmp_path / "out", workers=1) == 0
    check_stream(tmp_path / "out", in_memory("hf_datasets", str(tmp_path / "ds")))
    assert len(read_manifest(str(tmp_path / "out")).shards) >= 2


def test_units_cut_at_line_ends_and_keep_text_files_whole(tmp_path):
    pattern = write_jsonl(tmp_path / "c", files=2, lines=200)
    files = matched(pattern)
    sizes = [os.path.getsize(f) for f in files]
    units = plan_file_units(files, sizes, 3000, split=True)
    covered = {i: 0 for i in range(len(files))}
    for unit in units:
        for index, start, end in unit["pieces"]:
            data = Path(files[index]).read_bytes()
            assert start == covered[index] and (end == sizes[index] or data[end - 1] == 10)
            covered[index] = end
    assert covered == dict(enumerate(sizes)) and len(units) > 10
    whole = plan_file_units(files, sizes, 3000, split=False)
    assert [u["pieces"] for u in whole] == [[[0, 0, sizes[0]]], [[1, 0, sizes[1]]]]


# --- deterministic and resumable -------------------------------------------------------------


def test_same_bytes_twice_and_for_any_worker_count(tmp_path):
    pattern = write_jsonl(tmp_path / "c")
    for name, workers in (("one", 1), ("two", 2), ("again", 2)):
        assert prepare("jsonl", pattern, tmp_path / name, workers=workers) == 0
    one = all_files(tmp_path / "one")
    assert MANIFEST in one and one == all_files(tmp_path / "two") == all_files(tmp_path / "again")
    assert prepare("jsonl", pattern, tmp_path / "one") == 0  # finished: re-checked, nothing redone
    assert all_files(tmp_path / "one") == one


def test_invalid_utf8_is_counted_exactly_on_any_worker_count_and_on_resume(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c")
    first = matched(pattern)[0]
    data = Path(first).read_bytes()
    line = len(re.findall(rb"\r\n|\r|\n", data[: data.index(b"bad \xff")])) + 1
    notes = []
    for name, workers in (("one", 1), ("two", 2), ("two", 2)):  # the last reuses every unit
        capsys.readouterr()
        assert prepare("jsonl", pattern, tmp_path / name, workers=workers) == 0
        notes.append(capsys.readouterr().err)
    assert notes[0] == notes[1] == notes[2]
    assert notes[0].startswith("note: 18 documents held bytes that are not valid UTF-8")
    assert f"U+FFFD in their place (the first: {first}:{line})" in notes[0]


def test_rerun_redoes_only_damaged_or_missing_units(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c")
    assert prepare("jsonl", pattern, tmp_path / "out") == 0
    clean = all_files(tmp_path / "out")
    shards = sorted((tmp_path / "out").glob("shard-*.tokens"))
    # A deleted shard, a truncated one, a lost marker, a leftover temporary file, no manifest:
    # what a kill or an accident leaves behind.
    shards[1].unlink()
    with open(shards[3], "r+b") as f:
        f.truncate(10)
    (tmp_path / "out" / ".work" / "done-00005.json").unlink()
    (tmp_path / "out" / "shard-00006.tokens.tmp").write_bytes(b"partial")
    (tmp_path / "out" / MANIFEST).unlink()
    capsys.readouterr()
    assert prepare("jsonl", pattern, tmp_path / "out") == 0
    assert f"{len(shards) - 3} shards reused" in capsys.readouterr().out
    assert all_files(tmp_path / "out") == clean


@pytest.mark.slow
def test_resume_after_kill(tmp_path):
    pattern = write_jsonl(tmp_path / "c", files=4, lines=6000)
    tok = str(save_tiny_tokenizer(tmp_path / "tokenizer.json"))
    argv = ["--source", "jsonl", "--path", pattern, "--tokenizer", tok, "--workers", "1"]
    cmd = [sys.executable, "-m", "moetrain.prepare", *argv, "--shard-mb", "0.02"]
    work = tmp_path / "killed" / ".work"
    proc = subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "killed")], cwd=ROOT, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not list(work.glob("done-*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    units = len(json.loads((work / "plan.json").read_text())["units"])
    assert 0 < len(list(work.glob("done-*.json"))) < units, "killed too late to test resume"
    assert not (tmp_path / "killed" / MANIFEST).exists()
    done = subprocess.run([*cmd, "--out", str(tmp_path / "killed")], cwd=ROOT, timeout=300)
    assert done.returncode == 0
    assert main([*argv, "--shard-mb", "0.02", "--out", str(tmp_path / "clean")]) == 0
    assert all_files(tmp_path / "killed") == all_files(tmp_path / "clean")


# --- refusals: exit 2, one message naming the file and the fix -------------------------------


def refuse(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_jsonl_lines_are_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    args = ["--source", "jsonl", "--path", str(bad), "--out", str(tmp_path / "o")]
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    err = refuse(capsys, args)
    assert f"{bad}:2: not valid JSON" in err and "fix or delete that line" in err
    bad.write_text('{"text": "ok"}\n\n{"body": "x", "id": 3}\n')
    err = refuse(capsys, [*args, "--overwrite"])
    assert f"{bad}:3: no field 'text'" in err and "'body', 'id'" in err
    assert "--text-field" in err
    bad.write_text('{"text": 5}\n')
    assert "is int, not a string" in refuse(capsys, [*args, "--overwrite"])


def test_bad_line_deep_in_a_file_gets_its_own_line_number(tmp_path, capsys):
    good = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(400))
    (tmp_path / "c.jsonl").write_text(good + "not json\n" + good)
    argv = ["--source", "jsonl", "--path", str(tmp_path / "c.jsonl"), "--workers", "2"]
    err = refuse(capsys, [*argv, "--shard-mb", "0.01", "--out", str(tmp_path / "o")])
    assert "c.jsonl:401: not valid JSON" in err


def test_bad_tokenizer_file_no_files_and_empty_corpus(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c", files=1, lines=5)
    (tmp_path / "tokenizer.json").write_text("{ not a tokenizer")
    base = ["--source", "jsonl", "--out", str(tmp_path / "o")]
    err = refuse(
        capsys, [*base, "--path", pattern, "--tokenizer", str(tmp_path / "tokenizer.json")]
    )
    assert f"{tmp_path / 'tokenizer.json'} is not a valid tokenizer.json" in err
    assert "--tokenizer" in err and "byte" in err  # the fix: another file, or bytes
    err = refuse(capsys, [*base, "--path", str(tmp_path / "nothing" / "*.jsonl")])
    assert "matched no files" in err and "nothing" in err
    assert not (tmp_path / "o").exists()  # refused before anything is written
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    err = refuse(capsys, [*base, "--path", str(tmp_path / "e" / "*.jsonl")])
    assert "no non-empty document" in err and "--text-field" in err


def test_different_plan_needs_overwrite(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c", files=1, lines=50)
    assert prepare("jsonl", pattern, tmp_path / "out") == 0
    err = refuse(capsys, ["--source", "jsonl", "--path", pattern, "--out", str(tmp_path / "out")])
    assert "different plan (differs in: shard_mb)" in err and "--overwrite" in err
    assert prepare("jsonl", pattern, tmp_path / "out", "--overwrite", mb="1") == 0
    assert len(read_manifest(str(tmp_path / "out")).shards) == 1
    assert not list((tmp_path / "out").glob("shard-00001.*"))  # the old plan's shards are gone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    err = refuse(capsys, ["--source", "jsonl", "--path", pattern, "--out", str(tmp_path / "other")])
    assert "is not empty and holds no prepare plan" in err


def test_two_prepares_cannot_write_one_directory(tmp_path, capsys):
    import fcntl

    pattern = write_jsonl(tmp_path / "c", files=1, lines=20)
    (tmp_path / "out").mkdir()
    fd = os.open(tmp_path / "out", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running prepare holds it
        err = refuse(
            capsys, ["--source", "jsonl", "--path", pattern, "--out", str(tmp_path / "out")]
        )
        assert "another `python -m moetrain.prepare` is writing" in err
    finally:
        os.close(fd)
    assert prepare("jsonl", pattern, tmp_path / "out") == 0


def test_verify_names_a_corrupted_shard(tmp_path, capsys):
    pattern = write_jsonl(tmp_path / "c", files=1, lines=200)
    assert prepare("jsonl", pattern, tmp_path / "out") == 0
    capsys.readouterr()
    assert main(["--verify", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.startswith("verified ")
    shard = tmp_path / "out" / "shard-00002.tokens"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    err = refuse(capsys, ["--verify", "--out", str(tmp_path / "out")])
    assert str(shard) in err and "checksum" in err and "again" in err
    err = refuse(capsys, ["--verify", "--out", str(tmp_path / "missing")])
    assert "--out=" in err and "does not exist" in err and "data.path" not in err


def test_a_refused_prepare_leaves_nothing_that_blocks_its_rerun(tmp_path, capsys):
    corpus = tmp_path / "c" / "a.jsonl"
    corpus.parent.mkdir()
    corpus.write_text('{"text": "one"}\n{"text": "two"\n{"text": "three"}\n')
    argv = ["--source", "jsonl", "--path", str(corpus), "--out", str(tmp_path / "out")]
    assert "a.jsonl:2: not valid JSON" in refuse(capsys, argv)
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n')  # fixed
    assert main(argv) == 0  # no --overwrite needed: nothing had been prepared
    assert read_manifest(str(tmp_path / "out")).num_documents == 3
