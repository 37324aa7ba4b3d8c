"""One work unit of `python -m trainer.prepare`: read a slice of the corpus, tokenize it and
write it as one shard (the format of trainer/data/shards.py), then a done marker.

It runs in worker processes, so it imports neither torch nor the `trainer.data` package
(whose __init__ imports torch: seconds and hundreds of MB per process); what it needs comes
in the `job` dict that trainer/data/prepare.py builds. It must read exactly the documents of
trainer/data/sources.py, in order: a jsonl line as text-mode iteration gives it (utf-8 with
errors="replace", universal newlines), blank lines skipped, empty documents dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

WORK_DIR = ".work"  # plan.json and one done-NNNNN.json per finished unit
BATCH_CHARS = 1 << 20  # text per tokenizer call: bounds a worker's memory, amortises the call
READ_BYTES = 1 << 20  # bytes per read of a jsonl file
HF_ROWS = 1024  # rows per read of a datasets table

Job = dict[str, Any]
# (input bytes, documents, tokens, fresh): fresh is False for a unit found already done.
Report = Callable[[int, int, int, bool], None]


class UnitError(Exception):
    """Bad input, worded for the user: names the file (and line) and the fix."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def marker_path(out: str, index: int) -> str:
    return os.path.join(out, WORK_DIR, f"done-{index:05d}.json")


def fsync_dir(path: str) -> None:
    # A rename is durable only once the directory entry itself is flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write `path` so that a reader (or a killed run) sees the old file or the new, whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_json(path: str) -> Any:
    """The parsed file, or None where it is missing or not JSON (e.g. cut short by a kill)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sha256(path: str) -> str:  # shards.file_sha256, which this module cannot import
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- reading documents -----------------------------------------------------------------------


def _chunks(path: str, start: int, end: int) -> Iterator[bytes]:
    """Bytes [start, end) of a file in pieces of about READ_BYTES, each cut just after a b"\\n".

    Cutting after "\\n" keeps a "\\r\\n" pair and every UTF-8 sequence (which never contains
    byte 0x0A) whole, so decoding piece by piece equals decoding the whole file."""
    with open(path, "rb") as f:
        f.seek(start)
        pos, carry = start, bytearray()
        while pos < end:
            block = f.read(min(READ_BYTES, end - pos))
            if not block:
                break  # the file shrank since planning: read what is there
            pos += len(block)
            carry += block
            cut = carry.rfind(b"\n") + 1
            if cut:  # else a line longer than the block: keep reading
                yield bytes(carry[:cut])
                del carry[:cut]
        if carry:
            yield bytes(carry)


def _lines_before(path: str, offset: int) -> int:
    """How many lines precede byte `offset` (just after a "\\n"): only for error messages."""
    count = 0
    for chunk in _chunks(path, 0, offset):
        count += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
    return count


def _jsonl_text(line: str, field: str, path: str, start: int, lineno: int) -> str:
    """The document of one non-blank line; `lineno` counts from the piece's `start`."""

    def where() -> str:
        return f"{path}:{_lines_before(path, start) + lineno}"

    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UnitError(
            f"{where()}: not valid JSON ({err.msg} at column {err.colno}); fix or delete that "
            "line (every non-blank line of a .jsonl file must be one JSON object)"
        ) from None
    if not isinstance(record, dict):
        raise UnitError(
            f"{where()}: the line is a JSON {type(record).__name__}, not an object with a "
            f"{field!r} field; each line must be an object like {{{field!r}: ...}}"
        )
    if field not in record:
        raise UnitError(
            f"{where()}: no field {field!r}; the line has fields {list(record)[:10]}: pass "
            "--text-field with the one that holds the document text"
        )
    text = record[field]
    if not isinstance(text, str):
        raise UnitError(
            f"{where()}: field {field!r} is {type(text).__name__}, not a string; pass "
            "--text-field with the field that holds the document text"
        )
    return text


def _jsonl_documents(job: Job, unit: dict) -> Iterator[tuple[str, int]]:
    """(text, input bytes consumed): text "" carries only progress."""
    for file_index, start, end in unit["pieces"]:
        path = job["files"][file_index]
        lineno = 0  # within this piece; the absolute number is worked out only for errors
        for chunk in _chunks(path, start, end):
            text = chunk.decode("utf-8", errors="replace")
            if "\r" in text:  # universal newlines, as in text mode: \r\n, \r, \n end a line
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            # After a final newline, split gives one "" that is not a line.
            for line in text.split("\n")[: -1 if text.endswith("\n") else None]:
                lineno += 1
                if line.strip():
                    yield _jsonl_text(line, job["text_field"], path, start, lineno), 0
            yield "", len(chunk)


def _text_documents(job: Job, unit: dict) -> Iterator[tuple[str, int]]:
    for file_index, start, end in unit["pieces"]:
        # One document per file, read exactly as sources._read_text does.
        text = Path(job["files"][file_index]).read_text(encoding="utf-8", errors="replace")
        yield text, end - start


_HF_CACHE: dict[tuple[str, str, str], Any] = {}


def load_hf(path: str, split: str, field: str) -> Any:
    """The `datasets.Dataset` that sources._hf_documents reads (same choice, same refusals)."""
    key = (path, split, field)
    if key in _HF_CACHE:
        return _HF_CACHE[key]
    try:
        import datasets
    except ImportError:
        raise UnitError("--source hf_datasets needs `datasets` (pip install datasets)") from None
    local = os.path.expanduser(path)
    saved_markers = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, m)) for m in saved_markers):
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise UnitError(f"{local} has splits {list(ds)}, not {split!r}: pass --split")
            ds = ds[split]
    elif local.startswith(("/", ".", "~")) and not os.path.exists(local):
        raise UnitError(f"--path {path!r} does not exist (looked for a saved dataset directory)")
    else:
        try:
            ds = datasets.load_dataset(local, split=split)
        except Exception as err:  # datasets raises many kinds; all mean the same to the user
            raise UnitError(
                f"datasets.load_dataset({path!r}, split={split!r}) failed: {err}; check --path "
                "and --split"
            ) from None
    if field not in ds.column_names:
        raise UnitError(f"{path} has columns {ds.column_names}, no {field!r}: pass --text-field")
    _HF_CACHE[key] = ds.select_columns([field])
    return _HF_CACHE[key]


def _hf_documents(job: Job, unit: dict) -> Iterator[tuple[str, int]]:
    field = job["text_field"]
    ds = load_hf(job["hf"]["path"], job["hf"]["split"], field)
    lo, hi = unit["rows"]
    for a in range(lo, hi, HF_ROWS):
        b = min(a + HF_ROWS, hi)
        for row, text in enumerate(ds[a:b][field], start=a):
            if text and not isinstance(text, str):
                raise UnitError(
                    f"{job['hf']['path']} row {row}: column {field!r} holds "
                    f"{type(text).__name__}, not text; pass --text-field with a text column"
                )
            yield text or "", 0  # sources.py skips None and "" alike
        # Row ranges have no exact byte size: spread the unit's estimate over its rows.
        yield "", unit["bytes"] * (b - a) // max(1, hi - lo)


# --- tokenizing and writing ------------------------------------------------------------------

Encoder = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]  # -> (flat ids, lengths)
_TOKENIZERS: dict[str, Any] = {}


def _encoder(job: Job) -> Encoder:
    path = job["tokenizer_path"]
    if path is None:  # the byte tokenizer: ids are the UTF-8 bytes (tokenizers.ByteTokenizer)

        def encode_bytes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            encoded = [t.encode("utf-8") for t in texts]
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            return np.frombuffer(b"".join(encoded), np.uint8), lengths

        return encode_bytes
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[path] = Tokenizer.from_file(path)
    tok = _TOKENIZERS[path]

    def encode_hf(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # The call HFTokenizer.encode_batch makes: no special tokens, EOS is added by us.
        ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

    return encode_hf


def _encode_or_explain(encode: Encoder, batch: list[str], job: Job, unit: dict) -> tuple:
    try:
        return encode(batch)
    except Exception as err:  # e.g. a lone surrogate ("\\ud800" in JSON) has no UTF-8 bytes
        files = {job["files"][piece[0]] for piece in unit.get("pieces", [])}
        where = ", ".join(sorted(files)) or f"{job['hf']['path']} rows {unit.get('rows')}"
        raise UnitError(
            f"{where}: the tokenizer failed on a document ({type(err).__name__}: {err}); "
            "repair or remove that document"
        ) from None


class ShardWriter:
    """Streams one shard to temporary files, hashing as it goes; `finish` makes it final."""

    def __init__(self, out: str, name: str, dtype: str, eos_id: int) -> None:
        self.final = [os.path.join(out, name + suffix) for suffix in (".tokens", ".docs")]
        self.tmp = [p + ".tmp" for p in self.final]
        self.files = [open(p, "wb") for p in self.tmp]
        self.digests = [hashlib.sha256(), hashlib.sha256()]
        self.dtype, self.eos_id = np.dtype(dtype), eos_id
        self.tokens = self.documents = 0

    def _write(self, which: int, data: bytes) -> None:
        self.files[which].write(data)
        self.digests[which].update(data)

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> int:
        """Append documents (their ids concatenated in `flat`), each followed by EOS."""
        ends = np.cumsum(lengths + 1)  # end offset of each document, its EOS included
        tokens = np.full(int(ends[-1]), self.eos_id, dtype=self.dtype)
        not_eos = np.ones(len(tokens), dtype=bool)
        not_eos[ends - 1] = False
        tokens[not_eos] = flat
        self._write(0, tokens.tobytes())
        self._write(1, (ends + self.tokens).astype("<u8").tobytes())
        self.tokens += len(tokens)
        self.documents += len(lengths)
        return len(tokens)

    def finish(self) -> dict[str, Any]:
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for tmp, final in zip(self.tmp, self.final, strict=True):
            os.replace(tmp, final)
        fsync_dir(os.path.dirname(self.final[0]))
        sha, docs_sha = (d.hexdigest() for d in self.digests)
        return {"tokens": self.tokens, "documents": self.documents, "sha256": sha,
                "docs_sha256": docs_sha}  # fmt: skip

    def abort(self) -> None:
        for f, tmp in zip(self.files, self.tmp, strict=True):
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


def intact_marker(job: Job, index: int) -> dict | None:
    """The unit's done marker if it belongs to this plan and its files match it byte for byte."""
    marker = read_json(marker_path(job["out"], index))
    if not isinstance(marker, dict) or marker.get("unit") != job["units"][index]:
        return None
    base = os.path.join(job["out"], shard_name(index))
    width = np.dtype(job["dtype"]).itemsize
    try:
        tokens = (base + ".tokens", width * marker["tokens"], marker["sha256"])
        docs = (base + ".docs", 8 * marker["documents"], marker["docs_sha256"])
    except (KeyError, TypeError):
        return None  # not a marker this code wrote
    for path, size, digest in (tokens, docs):
        if not os.path.isfile(path) or os.path.getsize(path) != size or _sha256(path) != digest:
            return None
    return marker


def run_unit(
    job: Job, index: int, report: Report, alive: Callable[[], bool] = lambda: True
) -> dict:
    """Unit `index` as its done marker plus "reused"; {"error": message} for bad input."""
    unit = job["units"][index]
    marker = intact_marker(job, index)
    if marker is not None:
        report(unit["bytes"], marker["documents"], marker["tokens"], False)
        return {**marker, "reused": True}
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker_path(job["out"], index))  # its files are about to be replaced
    read = {"jsonl": _jsonl_documents, "text": _text_documents, "hf_datasets": _hf_documents}
    documents = read[job["kind"]](job, unit)
    encode = _encoder(job)
    writer = ShardWriter(job["out"], shard_name(index), job["dtype"], job["eos_id"])
    batch: list[str] = []
    chars = nbytes = 0

    def flush() -> None:
        nonlocal batch, chars, nbytes
        tokens = writer.add(*_encode_or_explain(encode, batch, job, unit)) if batch else 0
        report(nbytes, len(batch), tokens, True)
        batch, chars, nbytes = [], 0, 0
        if not alive():
            raise SystemExit(1)  # the main process is gone: stop, leave no marker

    try:
        for text, consumed in documents:
            nbytes += consumed
            if text:
                batch.append(text)
                chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
        flush()
        marker = {"unit": unit, **writer.finish()}
    except UnitError as err:
        writer.abort()
        return {"error": str(err)}
    except BaseException:
        writer.abort()
        raise
    write_atomic(marker_path(job["out"], index), json.dumps(marker, indent=1))
    return {**marker, "reused": False}


def serve(job: Job, tasks: Any, events: Any, stop: Any, progress: bool) -> None:
    """A worker process: run the unit indices from `tasks` until None; send events
    ("progress", bytes, docs, tokens, fresh), ("done", index, result), ("crash", index, tb)."""
    # N workers each starting N tokenizer threads would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    parent = mp.parent_process()

    def alive() -> bool:
        return parent is None or parent.is_alive()

    def report(nbytes: int, docs: int, tokens: int, fresh: bool) -> None:
        if progress:
            events.put(("progress", nbytes, docs, tokens, fresh))

    while (index := tasks.get()) is not None and not stop.is_set() and alive():
        try:
            events.put(("done", index, run_unit(job, index, report, alive)))
        except Exception:
            events.put(("crash", index, traceback.format_exc()))
            return
