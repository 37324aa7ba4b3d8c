"""UTF-8 as the readers decode it: bytes that are not UTF-8 become U+FFFD, exactly as
`errors="replace"` makes them (a corpus with a stray bad byte still reads), and the documents
where that happened are reported to whoever asks (`Replaced`), so that `python -m
moetrain.prepare` can say so instead of changing text in silence.

Decoding tries strict UTF-8 first and decodes again with replacement only where that fails:
the same speed for clean text, and the same text as a replacing decoder in every case.
No torch here: `prepare`'s workers import it.
"""

from __future__ import annotations

import codecs
import io
import re
from collections.abc import Callable

# Called once for each document in which bytes were replaced, with its place in words
# (worked out only when asked: finding a line number can mean reading the file again).
OnReplaced = Callable[[Callable[[], str]], None]

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")  # text mode's universal newlines


class Replaced:
    """An `OnReplaced` that keeps the count of documents and the place of the first one."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def __call__(self, where: Callable[[], str]) -> None:
        self.count += 1
        if self.first is None:
            self.first = where()


class TolerantDecoder(codecs.IncrementalDecoder):
    """An incremental UTF-8 decoder that replaces as errors="replace" does; `offset` is the
    stream offset of the first byte it replaced (None while there is none)."""

    def __init__(self, errors: str = "replace") -> None:
        super().__init__(errors)
        self._strict = codecs.getincrementaldecoder("utf-8")()
        self._fed = 0  # bytes passed to decode so far
        self.offset: int | None = None

    def decode(self, data: bytes, final: bool = False) -> str:
        state = self._strict.getstate()
        self._fed += len(data)
        try:
            return self._strict.decode(data, final)
        except UnicodeDecodeError as err:
            # NOTE: the strict decoder keeps its state when it raises; a replacing one
            # resumes from that state, so the text is what one replacing decoder gives.
            if self.offset is None:
                self.offset = self._fed - len(data) - len(state[0]) + err.start
            lenient = codecs.getincrementaldecoder("utf-8")("replace")
            lenient.setstate(state)
            text = lenient.decode(data, final)
            self._strict.setstate(lenient.getstate())
            return text

    def reset(self) -> None:
        self._strict.reset()

    def getstate(self) -> tuple[bytes, int]:
        return self._strict.getstate()

    def setstate(self, state: tuple[bytes, int]) -> None:
        self._strict.setstate(state)


def text_mode_decoder() -> tuple[io.IncrementalNewlineDecoder, TolerantDecoder]:
    """What `open(path, encoding="utf-8", errors="replace")` decodes with (universal
    newlines translated), and the UTF-8 part of it, which knows whether it replaced."""
    utf8 = TolerantDecoder()
    return io.IncrementalNewlineDecoder(utf8, translate=True), utf8


def decode_lines(chunk: bytes, replaced_line: Callable[[int], None] | None = None) -> str:
    """`chunk.decode("utf-8", errors="replace")`; with `replaced_line`, called with the index
    (from 0, universal newlines) of each line of `chunk` that held bytes it replaced.

    Lines are told apart on the bytes: "\\r" and "\\n" are never part of a UTF-8 sequence,
    so a line's bytes decode to what the whole chunk's decoding holds for that line."""
    try:
        return chunk.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if replaced_line is not None:
        for index, line in enumerate(_LINE_BREAK.split(chunk)):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                replaced_line(index)
    return chunk.decode("utf-8", errors="replace")
