"""How a corpus is read: one set of rules for the in-memory sources (`trainer.data.sources`)
and `prepare`'s workers (`trainer.prepare.worker`), so that both see the same documents in the
same order, and the same refusals.

- files: a glob, sorted, files only;
- text: one document per file, UTF-8 with invalid bytes replaced;
- JSON lines: one document per non-blank line, read as text mode would (UTF-8 with
  replacement, universal newlines), its `text_field` a string; a line that is not a JSON
  object with that field is refused by file:line;
- Hugging Face datasets: a saved directory (`load_from_disk`) or a hub name/script
  (`load_dataset`), one column; empty and None rows are skipped.

Messages name the option to fix in the caller's words: `data.*` keys for a training config,
`--flags` for `python -m trainer.prepare` (`Options`). No torch here: workers import this.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import DataError

READ_BYTES = 1 << 20  # bytes per read of a JSON-lines file
HF_ROWS = 1024  # rows per read of a datasets table


class Options(NamedTuple):
    """The names the user knows the reading options by."""

    path: str
    text_field: str
    split: str


CONFIG = Options("data.path", "data.text_field", "data.hf_split")
COMMAND_LINE = Options("--path", "--text-field", "--split")


def glob_files(pattern: str, what: str, opts: Options) -> list[str]:
    """The files matching `pattern` (`~` expanded, `**` recursive), sorted; refused if none."""
    expanded = os.path.expanduser(pattern)
    files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not files:
        hint = ""
        if os.path.isdir(expanded):
            hint = f" ({expanded!r} is a directory; try '{expanded.rstrip('/')}/**/*')"
        raise DataError(
            f"{opts.path}={pattern!r} matched no files (looked for {what} matching that glob, "
            f"relative to {os.getcwd()!r} unless absolute){hint}; quote the glob so that the "
            "shell does not expand it"
        )
    return files


def read_text(path: str | os.PathLike) -> str:
    # A stray invalid byte should not stop a training run.
    return Path(path).read_text(encoding="utf-8", errors="replace")


# --- JSON lines ---------------------------------------------------------------------------


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


def _jsonl_text(line: str, at: Callable[[], str], field: str, opts: Options) -> str:
    """The document of one non-blank line; `at()` is its file:line (worked out on error)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{at()}: not valid JSON ({err.msg} at column {err.colno}); fix or delete that "
            "line (every non-blank line of a .jsonl file must be one JSON object)"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{at()}: the line is a JSON {type(record).__name__}, not an object with a "
            f"{field!r} field; each line must be an object like {{{field!r}: ...}}"
        )
    if field not in record:
        has = ", ".join(map(repr, list(record)[:10])) or "none"
        raise DataError(
            f"{at()}: no field {field!r} in this line (it has: {has}); set "
            f"{opts.text_field} to the field that holds the document text"
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(
            f"{at()}: field {field!r} is {type(text).__name__}, not a string; set "
            f"{opts.text_field} to the field that holds the document text"
        )
    return text


def jsonl_documents(
    path: str, field: str, opts: Options, start: int = 0, end: int | None = None
) -> Iterator[tuple[str, int]]:
    """(text, input bytes consumed) of the lines in bytes [start, end) of a JSON-lines file;
    `start` must be 0 or just after a newline. A text "" carries only progress."""
    end = os.path.getsize(path) if end is None else end
    lineno = 0  # within this piece; the absolute number is worked out only for errors
    for chunk in _chunks(path, start, end):
        text = chunk.decode("utf-8", errors="replace")
        if "\r" in text:  # universal newlines, as in text mode: \r\n, \r, \n end a line
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        # After a final newline, split gives one "" that is not a line.
        for line in text.split("\n")[: -1 if text.endswith("\n") else None]:
            lineno += 1
            if line.strip():

                def at(n: int = lineno) -> str:
                    return f"{path}:{(_lines_before(path, start) if start else 0) + n}"

                yield _jsonl_text(line, at, field, opts), 0
        yield "", len(chunk)


# --- Hugging Face datasets ----------------------------------------------------------------


def load_hf_dataset(path: str, split: str, field: str, opts: Options) -> Any:
    """The `datasets.Dataset` of one column: a saved directory, or load_dataset's name."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset needs the optional `datasets` package (pip "
            "install datasets)"
        ) from None
    local = os.path.expanduser(path)
    saved_markers = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, m)) for m in saved_markers):
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(
                    f"{opts.path}={path!r} has splits {list(ds)}, not {split!r}: set {opts.split}"
                )
            ds = ds[split]
    elif local.startswith(("/", ".", "~")) and not os.path.exists(local):
        raise DataError(f"{opts.path}={path!r} does not exist (looked for a dataset directory)")
    else:
        try:
            ds = datasets.load_dataset(local, split=split)
        except Exception as err:  # datasets raises many kinds; all mean the same to the user
            raise DataError(
                f"datasets.load_dataset({opts.path}={path!r}, split={split!r}) failed: {err}; "
                f"check {opts.path} and {opts.split}"
            ) from None
    if field not in ds.column_names:
        raise DataError(
            f"{opts.path}={path!r} has columns {ds.column_names}, no {field!r}: set "
            f"{opts.text_field}"
        )
    return ds.select_columns([field])


def hf_documents(ds: Any, field: str, name: str, lo: int, hi: int) -> Iterator[tuple[str, int]]:
    """(text, 1) for each row of [lo, hi) of a one-column dataset (`load_hf_dataset`): text
    "" for an empty or None row, which readers skip. `name` says where, for errors."""
    for a in range(lo, hi, HF_ROWS):
        b = min(a + HF_ROWS, hi)
        texts = ds[a:b][field]  # a column slice: much faster than one row dict at a time
        for row, text in enumerate(texts, start=a):
            if text and not isinstance(text, str):
                raise DataError(
                    f"{name} row {row}: column {field!r} holds {type(text).__name__}, not text; "
                    "choose a text column"
                )
            yield text or "", 1
