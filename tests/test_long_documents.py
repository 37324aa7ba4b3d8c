"""Long documents in `python -m moetrain.prepare` (moetrain/prepare/long_docs.py,
moetrain/data/long_lines.py): streamed and tokenized in pieces, with the ids, the shards and
the refusals of the whole-document path, and a worker's memory flat in the document's length.
Thresholds are lowered so that small files take the long path."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetrain.data import long_lines, reader
from moetrain.data.reader import COMMAND_LINE, TextStream
from moetrain.data.shards import ShardedTokens, read_manifest
from moetrain.errors import DataError
from moetrain.prepare import long_docs
from moetrain.prepare.cli import main
from tests.test_prepare import ROOT, all_files, in_memory, refuse

# Every kind of boundary the pre-tokenizers treat apart, and what must not be cut through.
PARTS = ["word", "Cat", " ", " ", " ", "\n", "\n\n", "\n\n\n", "\r\n", "\r", "\t", "   ",
         " \t\n", ".\n", "!\n\n", ".", ", ", "é", "e\u0301", "😀", "𝔘𝔫𝔦", "中文", "，", "12345",
         " 42", "'s", "<|endoftext|>", "\u00a0", "x" * 700, "\\", '"']  # fmt: skip


def document(seed: int, parts: int = 3000) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PARTS) for _ in range(parts))


@pytest.fixture
def small(monkeypatch):
    """Thresholds small enough for a few KB to take the long path, cut in many pieces."""
    for name, value in (("STREAM_BYTES", 3000), ("PIECE_CHARS", 400), ("BATCH_CHARS", 1500),
                        ("CHECK_CHARS", 64), ("WARN_CHARS", 5000)):  # fmt: skip
        monkeypatch.setattr(long_docs, name, value)
    monkeypatch.setattr(reader, "READ_BYTES", 257)


# --- tokenizers of every pre-tokenizing kind, trained here -----------------------------------


def _train(kind: str):
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    corpus = [document(i, 400) for i in range(30)]
    special = ["<unk>", "<|endoftext|>"]
    if kind == "unigram":  # (its trainer is slow on long pieces)
        tok, corpus = Tokenizer(models.Unigram()), corpus[:10]
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=special, unk_token="<unk>",
                                          max_piece_length=8, show_progress=False)  # fmt: skip
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace_bpe" else None))
        alphabet = pre_tokenizers.ByteLevel.alphabet() if kind.startswith("bytelevel") else []
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=special,
                                      initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    if kind == "bytelevel_split":  # Qwen2's: NFC and GPT-4's regex, then bytes
        regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]"
                 r"+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), "isolated"), pre_tokenizers.ByteLevel(False, False)]
        )
    elif kind == "bytelevel_prefix":  # GPT-2's regex, with add_prefix_space (RoBERTa-like)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif kind in ("unigram", "metaspace_bpe"):
        tok.pre_tokenizer = pre_tokenizers.Metaspace()  # prepend_scheme="always"
    elif kind == "bert":
        tok.normalizer = normalizers.BertNormalizer()
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    elif kind == "prepend":  # Llama-2's: no pre-tokenizer, "▁" prepended: nowhere to cut
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return tok


class Parts:
    """A ShardWriter's add_part/add, recorded."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.ends = 0

    def add_part(self, ids: np.ndarray) -> None:
        self.parts.append(ids)

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> int:
        assert len(flat) == 0 and list(lengths) == [0]
        self.ends += 1
        return 1


def stream(text: str, seed: int = 0) -> TextStream:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 300)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return TextStream(iter(chunks), lambda: "doc.jsonl:7")


def pieces_of(text: str, tok) -> Parts:
    writer = Parts()
    long_docs.write(stream(text), writer, tok, lambda *a: None, lambda: True)
    assert writer.ends == 1
    return writer


@pytest.mark.parametrize(
    "kind", ["bytelevel_split", "bytelevel_prefix", "unigram", "metaspace_bpe", "bert"]
)
def test_pieces_give_the_ids_of_the_whole_document(small, kind, capsys):
    tok = _train(kind)
    for seed in range(2):
        text = document(100 + seed)
        writer = pieces_of(text, tok)
        whole = tok.encode(text, add_special_tokens=False).ids
        assert np.concatenate(writer.parts).tolist() == whole
        assert len(text) // len(writer.parts) < 3 * long_docs.PIECE_CHARS  # cut many times
    assert not capsys.readouterr().err


def test_nowhere_to_cut_is_said_and_stays_exact(small, capsys):
    tok = _train("prepend")
    text = document(7)
    writer = pieces_of(text, tok)
    assert np.concatenate(writer.parts).tolist() == tok.encode(text, add_special_tokens=False).ids
    assert len(writer.parts) == 1  # no piece could be cut off
    err = capsys.readouterr().err
    assert err.count("warning: doc.jsonl:7: no place to cut") == 1 and "exact" in err


def test_byte_tokenizer_cuts_anywhere(small):
    text = document(3)
    writer = pieces_of(text, None)
    assert np.concatenate(writer.parts).tobytes() == text.encode()


# --- reading: the stream is the text the whole-line path reads -------------------------------

JUNK = ['"', "\\", "\\u", "d83d", "\\ud83d", "\\ude00", "\\n", '\\"', "abc", " ", "\t", "{", "}",
        "[", "]", ",", ":", '"text"', "1", "-2.5e3", "true", "null", "NaN", "\x01", "é", "😀",
        "\\u00e9", "\\uD83D", "\\x", "\u3000", "\ufeff", "\\ud800", '{"text": "', '"}', "\\u12"]  # fmt: skip


def _verdict(feed_line, line: str):
    try:
        return "ok", feed_line(line)
    except json.JSONDecodeError as err:
        return "json", err.msg, err.colno
    except DataError as err:
        return "refused", str(err)


def _streamed(line: str, rng: random.Random) -> str | None:
    parser, out, i = long_lines.LineParser("text"), [], 0
    while i < len(line):
        n = rng.randint(1, 9)
        out += parser.feed(line[i : i + n])
        i += n
    if parser.blank:
        return None
    reader._record_text(parser.finish(), lambda: "f:1", "text", COMMAND_LINE)
    return "".join(out) if parser.field_keys <= 1 else "refused: the field twice"


def _whole(line: str) -> str | None:
    if not line.strip():
        return None
    return reader._record_text(json.loads(line), lambda: "f:1", "text", COMMAND_LINE)


def test_a_streamed_line_is_read_and_refused_as_json_loads_reads_it():
    rng = random.Random(0)
    values = ["", "x", 'ab\ncd"e\\\ud83d\ude00\u00e9\ud800z\x1f', 5, None, [1, "q"], {"text": 1}]
    for _ in range(4000):
        if rng.random() < 0.5:  # a record, perhaps damaged
            keys = rng.sample(["a", "text", "b"], rng.randint(0, 3))
            line = json.dumps(
                {k: rng.choice(values) for k in keys}, ensure_ascii=rng.random() < 0.5
            )
            for _ in range(rng.randint(0, 2)):
                at = rng.randint(0, len(line))
                line = line[:at] + rng.choice(JUNK) + line[at + rng.randint(0, 2) :]
        else:
            line = "".join(rng.choice(JUNK) for _ in range(rng.randint(0, 12)))
        streamed = _verdict(lambda x: _streamed(x, rng), line)
        if streamed == ("ok", "refused: the field twice"):  # json.loads keeps the last
            pairs = json.loads(line, object_pairs_hook=lambda pairs: pairs)
            assert [key for key, _ in pairs].count("text") == 2, line
            continue
        assert streamed == _verdict(_whole, line), line


def write_messy_jsonl(path: Path, seed: int = 0) -> None:
    """Long and short lines, escapes of every kind, \\r\\n, lone \\r, blank lines, an invalid
    byte: every line end and sequence lands on a read boundary somewhere."""
    rng = random.Random(seed)
    out = bytearray()
    for i in range(24):
        text = document(seed * 100 + i, rng.choice([5, 40, 600]))
        record = {"id": i, "text": text, "meta": "m" * rng.randint(0, 4000)}
        if i % 7 in (3, 5):  # long for another field; with an empty text: no document
            record = {"meta": text, "text": text[:50] if i % 7 == 3 else ""}
        out += json.dumps(record, ensure_ascii=i % 2 == 0).encode()
        out += rng.choice([b"\n", b"\r\n", b"\r", b"\n  \n", b"\r\r\n"])
        if i % 5 == 2:
            out += b'{"text": "bad \xff byte \xe2\x82 cut", "pair": "\\ud83d\\ude00"}\n'
    path.write_bytes(bytes(out))


@pytest.mark.parametrize("read_bytes", [97, 4096])
def test_streamed_lines_give_the_documents_of_the_whole_lines(small, tmp_path, read_bytes):
    path = tmp_path / "a.jsonl"
    write_messy_jsonl(path)
    expected = [t for t, _ in reader.jsonl_documents(str(path), "text", COMMAND_LINE) if t]
    reader.READ_BYTES = read_bytes  # the fixture restores it
    got, consumed, streams = [], 0, 0
    for text, nbytes in reader.jsonl_documents(str(path), "text", COMMAND_LINE, 0, None, 1000):
        consumed += nbytes
        if isinstance(text, TextStream):
            streams += 1
            text = "".join(text)
        if text:
            got.append(text)
    assert got == expected and consumed == path.stat().st_size and streams >= 8


def test_streamed_text_file_is_read_text(small, tmp_path):
    rng = random.Random(1)
    body = document(5, 4000).encode() + b"\xff\xe2\x82" + b"\r\n" * 300 + b"\r"
    path = tmp_path / "t.txt"
    path.write_bytes(body)
    for read_bytes in (1, 7, 256, rng.randint(300, 900)):
        reader.READ_BYTES = read_bytes
        doc = reader.text_document(str(path), 100)
        assert isinstance(doc, TextStream) and "".join(doc) == reader.read_text(path)
    assert reader.text_document(str(path), len(body)) == reader.read_text(path)


# --- through `python -m moetrain.prepare` -----------------------------------------------------


def tokens_of(out: Path) -> np.ndarray:
    return ShardedTokens(str(out), read_manifest(str(out)))[:].astype(np.int64)


def long_corpus(root: Path) -> tuple[str, str]:
    """(a jsonl glob, a text glob) with long documents among short ones."""
    root.mkdir()
    # The first line's first 12 reads of 257 bytes are its head (> STREAM_BYTES): that read
    # ends between the halves of a surrogate pair, and the next one inside another pair.
    start = '{"text": " say \\"hi\\"\\n caf\\u00e9 '
    body = start + "w " * ((12 * 257 - 6 - len(start)) // 2) + "\\ud83d\\ude00" * 23
    assert body.index("\\ud83d") == 12 * 257 - 6 and (13 * 257 - 12 * 257 + 6) % 12 == 11
    escaped = document(1, 2000).replace("\\", "/").replace('"', "'").replace("\n", "\\n")
    lines = [body + escaped.replace("\r", "\\r").replace("\t", " ") + '"}']
    lines += [json.dumps({"text": document(i, n)}) for i, n in ((2, 30), (3, 1500), (4, 20))]
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    write_messy_jsonl(root / "b.jsonl", seed=2)
    for i, n in enumerate((3000, 20, 2500)):
        (root / f"t{i}.txt").write_bytes(document(10 + i, n).encode() + b"\xe2\x82\r\n\r")
    return str(root / "*.jsonl"), str(root / "*.txt")


@pytest.mark.parametrize("source", ["jsonl", "text"])
@pytest.mark.parametrize("tokenizer", ["byte", "tokenizer.json"])
def test_prepare_long_documents_equals_in_memory(small, tmp_path, source, tokenizer):
    jsonl, text = long_corpus(tmp_path / "c")
    path = jsonl if source == "jsonl" else text
    if tokenizer != "byte":
        tokenizer = str(tmp_path / "tokenizer.json")
        _train("bytelevel_split").save(tokenizer)
    argv = ["--source", source, "--path", path, "--tokenizer", tokenizer, "--shard-mb", "0.02"]
    assert main([*argv, "--out", str(tmp_path / "streamed"), "--workers", "1"]) == 0
    expected = in_memory(source, path, tokenizer)
    np.testing.assert_array_equal(tokens_of(tmp_path / "streamed"), expected)
    long_docs.STREAM_BYTES = 1 << 30  # the whole-document path, on two workers: same bytes
    assert main([*argv, "--out", str(tmp_path / "whole"), "--workers", "2"]) == 0
    assert all_files(tmp_path / "streamed") == all_files(tmp_path / "whole")


BAD_LINES = [
    ('{"text": "%s", "b": [1, 2,, 3]}', "not valid JSON (Expecting value"),
    ('{"text": "%s\x01"}', "not valid JSON (Invalid control character at"),
    ('{"text": "%s\\x"}', "not valid JSON (Invalid \\escape"),
    ('{"text": "%s\\ud83d\\u12"}', "not valid JSON (Invalid \\uXXXX escape"),
    ('{"text": "%s"} extra', "not valid JSON (Extra data"),
    ('{"text": "%s', "not valid JSON (Unterminated string starting at at column 10)"),
    ('{"body": "%s", "id": 3}', "no field 'text' in this line (it has: 'body', 'id')"),
    ('{"text": ["%s"]}', "field 'text' is list, not a string"),
    ('["%s"]', "the line is a JSON list, not an object"),
]


@pytest.mark.parametrize("bad, says", BAD_LINES)
def test_a_bad_long_line_is_refused_as_a_short_one_is(small, tmp_path, capsys, bad, says):
    good = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40))
    path = tmp_path / "c.jsonl"
    path.write_text(good + "\r\n" + bad.replace("%s", "long text \\n" * 600) + "\n" + good)
    argv = ["--source", "jsonl", "--path", str(path), "--workers", "1", "--shard-mb", "0.005"]
    err = refuse(capsys, [*argv, "--out", str(tmp_path / "streamed")])
    assert f"{path}:42: {says}" in err  # in the unit after the first: lines before it counted
    long_docs.STREAM_BYTES = 1 << 30
    assert refuse(capsys, [*argv, "--out", str(tmp_path / "whole")]) == err


def test_a_long_line_naming_its_field_twice_is_refused(small, tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "%s", "text": "again"}\n' % ("x " * 3000))
    argv = ["--source", "jsonl", "--path", str(path), "--out", str(tmp_path / "o")]
    err = refuse(capsys, [*argv, "--workers", "1"])
    assert f"{path}:1: field 'text' appears 2 times in this line" in err and "keep one" in err


# --- a worker's memory ------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _peak_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return max(int(line.split()[1]) / 1024 for line in f if line[:5] in ("VmHWM", "VmRSS"))
    except (OSError, ValueError):
        return 0.0


@pytest.mark.slow
def test_a_workers_memory_stays_flat_on_a_long_line(tmp_path):
    """A 12 MB line: tokenized whole, a worker took about 150 bytes of memory per byte of
    line (3.5 GB for 24 MB); the bound is 1 GB."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("etaoinshrdlué"), 6)) for _ in range(3000)])
    seps = np.array([" "] * 8 + [", ", ".\n", "\n\n", "\t", ' "q" '])

    def text(n: int) -> str:
        return "".join(np.char.add(rng.choice(words, n), rng.choice(seps, n)))

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the fast kind: the test's time
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "</s>"],
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator([text(500) for _ in range(100)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    short = "".join(json.dumps({"text": text(200)}) + "\n" for _ in range(1000))
    with open(tmp_path / "c.jsonl", "w") as f:  # units: short lines, the long line, short
        f.write(short + json.dumps({"text": text(1_750_000)}) + "\n" + short)
    assert (tmp_path / "c.jsonl").stat().st_size > 12e6
    cmd = [sys.executable, "-m", "moetrain.prepare", "--source", "jsonl", "--path",
           str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json"),
           "--out", str(tmp_path / "out"), "--workers", "2", "--shard-mb", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks: dict[int, float] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            peaks[pid] = max(peaks.get(pid, 0.0), _peak_mib(pid))
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert len(peaks) >= 3, peaks  # the forkserver and two workers
    print(f"peak RSS of prepare's processes, MiB: {sorted(peaks.values())}")
    assert max(peaks.values()) < 1024, peaks
    assert read_manifest(str(tmp_path / "out")).num_documents == 2001
