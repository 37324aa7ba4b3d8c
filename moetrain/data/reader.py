"""How a corpus is read: one set of rules for the in-memory sources (`moetrain.data.sources`)
and `prepare`'s workers (`moetrain.prepare.worker`), so that both see the same documents in the
same order, and the same refusals.

- files: a glob, sorted, files only;
- text: one document per file, UTF-8 with invalid bytes replaced;
- JSON lines: one document per non-blank line, read as text mode would (UTF-8 with
  replacement, universal newlines), its `text_field` a string; a line that is not a JSON
  object with that field is refused by file:line;
- long documents (`stream_over`, for `prepare`'s workers): the same text as a `TextStream`
  of chunks read as they are used, never held whole (moetrain/data/long_lines.py);
- Hugging Face datasets: a saved directory (`load_from_disk`) or a hub name/script
  (`load_dataset`), one column; empty and None rows are skipped.

Messages name the option to fix in the caller's words: `data.*` keys for a training config,
`--flags` for `python -m moetrain.prepare` (`Options`). No torch here: workers import this.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from moetrain.data import long_lines
from moetrain.data.utf8 import (
    OnReplaced,
    TolerantDecoder,
    decode_lines,
    text_mode_decoder,
)
from moetrain.errors import DataError

READ_BYTES = 1 << 20  # bytes per read of a JSON-lines file


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


def read_text(path: str | os.PathLike, on_replaced: OnReplaced | None = None) -> str:
    """The file as text mode reads it (UTF-8 with replacement, universal newlines): a stray
    invalid byte should not stop a run, but `on_replaced` hears of it (`moetrain.data.utf8`)."""
    data = Path(path).read_bytes()
    decoder, utf8 = text_mode_decoder()
    text = decoder.decode(data, final=True)
    if on_replaced is not None and utf8.offset is not None:
        on_replaced(_place(str(path), utf8.offset))
    return text


def _place(path: str, offset: int) -> Callable[[], str]:
    """file:line of byte `offset`, worked out when asked (the same whether the file was
    read whole or streamed: a prepared directory's records must not depend on it)."""
    return lambda: f"{path}:{lines_before(path, offset) + 1}"


class TextStream:
    """A document too long to hold: its text in chunks, read as they are iterated (once, to
    the end, before the next document); `where()` names it in messages (file or file:line)."""

    def __init__(self, chunks: Iterator[str], where: Callable[[], str]) -> None:
        self.chunks, self.where = chunks, where

    def __iter__(self) -> Iterator[str]:
        return self.chunks


def text_document(
    path: str, stream_over: int | None = None, on_replaced: OnReplaced | None = None
) -> str | TextStream:
    """`read_text(path)`, or for a file of more than `stream_over` bytes the same text as a
    TextStream."""
    if stream_over is None or os.path.getsize(path) <= stream_over:
        return read_text(path, on_replaced)
    return TextStream(_text_chunks(path, on_replaced), lambda: path)


def _text_chunks(path: str, on_replaced: OnReplaced | None) -> Iterator[str]:
    # Text mode's decoders, as read_text's: they keep a character or a "\r\n" that a read
    # cuts whole, so the chunks concatenate to read_text's text.
    decoder, utf8 = text_mode_decoder()
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            if chunk := decoder.decode(block):
                yield chunk
    if chunk := decoder.decode(b"", final=True):
        yield chunk
    if on_replaced is not None and utf8.offset is not None:
        on_replaced(_place(path, utf8.offset))


# --- JSON lines ---------------------------------------------------------------------------


def line_chunks(
    path: str, start: int, end: int, stream_over: int | None = None
) -> Iterator[bytes | _LongLine]:
    """Bytes [start, end) of a file in pieces of about READ_BYTES, each cut just after a b"\\n".

    Cutting after "\\n" keeps a "\\r\\n" pair and every UTF-8 sequence (which never contains
    byte 0x0A) whole, so decoding piece by piece equals decoding the whole file. With
    `stream_over`, a line longer than that comes as a `_LongLine` (read it before the next
    piece), the lines before it cut just after a lone "\\r" (0x0D is never in a sequence
    either)."""
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
            if stream_over is not None and len(carry) > stream_over:
                # NOTE: not after a last "\r": its "\n" may be in the next block.
                head = carry.rfind(b"\r", 0, len(carry) - 1) + 1
                if head:
                    yield bytes(carry[:head])
                    del carry[:head]
                if len(carry) > stream_over:
                    line = _LongLine(f, bytes(carry), pos, end)
                    yield line
                    for _ in line:  # what the caller left unread
                        pass
                    carry, pos = bytearray(line.rest), line.pos
        if carry:
            yield bytes(carry)


_LINE_END = re.compile(rb"[\r\n]")


class _LongLine:
    """A line met by `line_chunks`: its bytes, less its line end, in blocks as they are read
    (once); then `nbytes` counts them with the line end, and `rest` is what was read after."""

    def __init__(self, f: IO[bytes], head: bytes, pos: int, end: int) -> None:
        self.f, self.pos, self.end = f, pos, end
        self.nbytes, self.rest = 0, b""
        self.blocks = self._blocks(head)

    def __iter__(self) -> Iterator[bytes]:
        return self.blocks

    def _read(self) -> bytes:
        block = self.f.read(min(READ_BYTES, self.end - self.pos)) if self.pos < self.end else b""
        self.pos += len(block)
        return block

    def _blocks(self, data: bytes) -> Iterator[bytes]:
        while data:
            found = _LINE_END.search(data)
            if found is None:
                yield data
                self.nbytes += len(data)
                data = self._read()
                continue
            stop = found.start()
            yield data[:stop]
            after = stop + 1
            if data[stop] == 0x0D:  # "\r", or "\r\n" (its "\n" perhaps in the next block)
                if after == len(data):
                    data += self._read()
                after += data[after : after + 1] == b"\n"
            self.nbytes += after
            self.rest = data[after:]
            return


def lines_before(path: str, offset: int) -> int:
    """How many lines precede byte `offset` (just after a "\\n"): only for error messages."""
    count, last = 0, b""
    with open(path, "rb") as f:
        while f.tell() < offset and (block := f.read(min(READ_BYTES, offset - f.tell()))):
            count += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
            count -= last == b"\r" and block[:1] == b"\n"  # a "\r\n" across two blocks
            last = block[-1:]
    return count


def _not_json(where: str, msg: str, colno: int) -> DataError:
    return DataError(
        f"{where}: not valid JSON ({msg} at column {colno}); fix or delete that line (every "
        "non-blank line of a .jsonl file must be one JSON object)"
    )


def _jsonl_text(line: str, at: Callable[[], str], field: str, opts: Options) -> str:
    """The document of one non-blank line; `at()` is its file:line (worked out on error)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise _not_json(at(), err.msg, err.colno) from None
    return _record_text(record, at, field, opts)


def _record_text(record: Any, at: Callable[[], str], field: str, opts: Options) -> Any:
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


def _long_line(
    chunks: Iterable[str], at: Callable[[], str], field: str, opts: Options
) -> TextStream:
    """The document of one long line as a stream, refused at its end as `_jsonl_text`
    refuses it."""

    def check(parser: long_lines.LineParser) -> None:
        if parser.blank:  # as line.strip() sees it: no document
            return
        try:
            record = parser.finish()
        except json.JSONDecodeError as err:
            raise _not_json(at(), err.msg, err.colno) from None
        _record_text(record, at, field, opts)
        if parser.field_keys > 1:
            raise DataError(
                f"{at()}: field {field!r} appears {parser.field_keys} times in this line; a "
                "line this long is read as a stream, which cannot keep only the last one as "
                "json.loads does: keep one"
            )

    return TextStream(long_lines.text_of_line(chunks, field, check), at)


def _decoded(
    blocks: Iterable[bytes], at: Callable[[], str], on_replaced: OnReplaced | None
) -> Iterator[str]:
    """UTF-8 with replacement, as `bytes.decode` of all of them: a sequence that a block
    boundary cuts is held until the next."""
    decoder = TolerantDecoder()
    for block in blocks:
        yield decoder.decode(block)
    yield decoder.decode(b"", final=True)
    if on_replaced is not None and decoder.offset is not None:
        on_replaced(at)


def jsonl_documents(
    path: str,
    field: str,
    opts: Options,
    start: int = 0,
    end: int | None = None,
    stream_over: int | None = None,
    on_replaced: OnReplaced | None = None,
) -> Iterator[tuple[str | TextStream, int]]:
    """(text, input bytes consumed) of the lines in bytes [start, end) of a JSON-lines file;
    `start` must be 0 or just after a newline. A text "" carries only progress. With
    `stream_over`, a line longer than that (bytes, or characters) comes as a TextStream.
    `on_replaced` hears of each line that held bytes that are not UTF-8."""
    end = os.path.getsize(path) if end is None else end
    lineno = 0  # within this piece; the absolute number is worked out only for errors

    def where(n: int) -> Callable[[], str]:
        return lambda: f"{path}:{(lines_before(path, start) if start else 0) + n}"

    for chunk in line_chunks(path, start, end, stream_over):
        if isinstance(chunk, _LongLine):
            lineno += 1
            chunks = _decoded(chunk, where(lineno), on_replaced)
            yield (stream := _long_line(chunks, where(lineno), field, opts)), 0
            for _ in stream:  # what the caller left unread: refused all the same
                pass
            yield "", chunk.nbytes
            continue
        replaced_line = None
        if on_replaced is not None:

            def replaced_line(index: int, before: int = lineno) -> None:
                on_replaced(where(before + index + 1))

        text = decode_lines(chunk, replaced_line)
        if "\r" in text:  # universal newlines, as in text mode: \r\n, \r, \n end a line
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        # After a final newline, split gives one "" that is not a line.
        for line in text.split("\n")[: -1 if text.endswith("\n") else None]:
            lineno += 1
            if not line.strip():
                continue
            if stream_over is not None and len(line) > stream_over:
                pieces = (line[i : i + READ_BYTES] for i in range(0, len(line), READ_BYTES))
                yield (stream := _long_line(pieces, where(lineno), field, opts)), 0
                for _ in stream:
                    pass
            else:
                yield _jsonl_text(line, where(lineno), field, opts), 0
        yield "", len(chunk)


# --- Hugging Face datasets ----------------------------------------------------------------
