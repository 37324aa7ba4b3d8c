"""A JSON line too long to hold in memory: its text field streamed in chunks as the line is
read, and the whole line still checked as `json.loads` checks it (`reader.jsonl_documents`
with `long_chars`; the rules are `moetrain.data.reader`'s).

How: one pass over the line's characters keeps a "skeleton" of it: the line less the content
of its value strings (and of JSON whitespace runs), which is small however long the strings
are. The text field's content is decoded as it goes by; at the end of the line, `json.loads`
of the skeleton gives exactly the verdict, the first error and the record (less the elided
content) that `json.loads` of the line would give, its error positions mapped back to
columns of the line. So a bad long line is refused by file:line with the same message.

What is elided is always a run of valid string content cut between whole escapes, never
between the two halves of a surrogate pair (`\\ud83d\\ude00`), so that the skeleton scans
exactly as the line does. Whatever the scan cannot yet decide (an escape cut by the end of a
chunk) waits for the next chunk; an invalid character or escape stops the pass, and the rest
of the chunk goes to the skeleton as it is, where `json.loads` finds the error.

Not streamed: keys of the top-level object (kept whole, to find the field and to name them in
messages), and what is not a string (numbers, literals, nesting): a line made mostly of those
is held in its skeleton.

NOTE: `json.loads` keeps the last of duplicate keys; a stream cannot take back what it has
sent, so a long line that names the text field twice is refused.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterable, Iterator
from json.decoder import scanstring
from typing import Any

# Valid string content as whole units: a run of plain characters, a simple escape, a \\u
# escape that is not a high surrogate, a surrogate pair, or a high surrogate whose next
# characters show that no low one follows. Possessive: a match never backtracks.
_RUN = re.compile(
    r"""(?:[^"\\\x00-\x1f]++
    |\\["\\/bfnrt]
    |\\u(?![dD][89abAB])[0-9a-fA-F]{4}
    |\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}
    |\\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]|\\[^u]|\\u(?![dD][c-fC-F])[0-9a-fA-F]{2})
    )*+""",
    re.VERBOSE,
)
_LONGEST_UNIT = 12  # a surrogate pair: fewer characters than this after a "\\" may be cut
# Outside strings: a run of JSON whitespace, a structural character, a quote, or a run of
# anything else (numbers, literals, and characters json.loads will refuse).
_TOKEN = re.compile(r'[ \t]++|[{}\[\],:"]|[^ \t{}\[\],:"]++')

KEY, TEXT, OTHER = "key", "text", "other"  # what the string being read is


class LineParser:
    """Feed a line's characters in chunks (no line end among them): `feed` yields the text
    field's decoded content; `finish` checks the line."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.skeleton: list[str] = []
        self.kept = 0  # characters in the skeleton
        self.cuts: list[int] = []  # skeleton positions where characters were elided, ascending
        self.elided: list[int] = []  # characters elided at cuts[:i + 1], cumulative
        self.stack: list[str] = []  # open "{" and "["
        self.after = ""  # the last "{", "[", ",", ":" or "v" (a value) outside strings
        self.mode: str | None = None  # inside a string: KEY, TEXT or OTHER
        self.pending = ""  # string content that waits for the next chunk (a cut escape)
        self.key: list[str] = []  # the raw content of the key being read
        self.last_key: str | None = None
        self.field_keys = 0  # times the field is a key of the top-level object
        self.blank = True  # only whitespace so far (str.isspace, as `line.strip()` sees it)
        self.broken = False  # an invalid string: the rest of the line is not needed

    def _keep(self, text: str) -> None:
        self.skeleton.append(text)
        self.kept += len(text)

    def _elide(self, count: int) -> None:
        if count:
            if self.cuts and self.cuts[-1] == self.kept:
                self.elided[-1] += count
            else:
                self.cuts.append(self.kept)
                self.elided.append((self.elided[-1] if self.elided else 0) + count)

    def column(self, pos: int) -> int:
        """The line's column (1-based) of the skeleton's position `pos`."""
        i = bisect.bisect_right(self.cuts, pos)
        return pos + (self.elided[i - 1] if i else 0) + 1

    def feed(self, chunk: str) -> Iterator[str]:
        if self.broken or not chunk:
            return
        self.blank = self.blank and chunk.isspace()
        i = 0
        while i < len(chunk) and not self.broken:
            if self.mode is None:
                i = self._outside(chunk, i)
            else:
                i = yield from self._string(chunk, i)

    def _outside(self, chunk: str, i: int) -> int:
        m = _TOKEN.match(chunk, i)
        token = m.group()
        c = token[0]
        if c in " \t":  # one whitespace character scans as a run does
            self._keep(c)
            self._elide(len(token) - 1)
            return m.end()
        self._keep(token)
        if c == '"':
            top = self.stack == ["{"]
            if top and self.after in ("{", ","):
                self.mode, self.key = KEY, []
            elif top and self.after == ":" and self.last_key == self.field and self.field_keys == 1:
                self.mode = TEXT
            else:
                self.mode = OTHER
        elif c in "{[":
            self.stack.append(c)
            self.after = c
        elif c in "}]":
            if self.stack:
                self.stack.pop()
            self.after = "v"
        else:
            self.after = c if c in ",:" else "v"
        return m.end()

    def _string(self, chunk: str, i: int) -> Iterator[str]:
        """Read string content from chunk[i:]; returns the index after what was read."""
        s = self.pending + chunk[i:] if self.pending else chunk[i:]
        held = len(self.pending)
        # NOTE: the last characters wait, so that a line end after them finds them in the
        # skeleton: json.loads refuses a string cut just after an escape by that escape.
        cut = _RUN.match(s, 0, max(0, len(s) - _LONGEST_UNIT)).end()
        end = _RUN.match(s, cut).end()
        closed = end < len(s) and s[end] == '"'
        if not closed and end < len(s) and (s[end] != "\\" or len(s) - end >= _LONGEST_UNIT):
            self._keep(s)  # invalid here: json.loads of the skeleton names the error
            self.broken, self.pending = True, ""
            return len(chunk)
        run = s[:end] if closed else s[:cut]
        if self.mode == KEY:
            self._keep(run)
            self.key.append(run)
        else:
            if self.mode == TEXT and run:
                yield scanstring(run + '"', 0)[0] if "\\" in run else run
            self._elide(len(run))
        if not closed:
            self.pending = s[cut:]
            return len(chunk)
        self._keep('"')
        if self.mode == KEY:
            self.last_key = _decoded("".join(self.key))
            self.field_keys += self.last_key == self.field
        self.mode, self.pending, self.after = None, "", "v"
        return i + end + 1 - held

    def finish(self) -> Any:
        """The record as json.loads gives it (value strings less their content) for a line
        that is not `blank`; json.JSONDecodeError (its `colno` the line's) for a bad one."""
        self._keep(self.pending)  # a string the line end cut: json.loads says so
        skeleton = "".join(self.skeleton)
        try:
            return json.loads(skeleton)
        except json.JSONDecodeError as err:
            bad = json.JSONDecodeError(err.msg, skeleton, err.pos)
            bad.colno = self.column(err.pos)
            raise bad from None


def _decoded(raw: str) -> str | None:
    try:
        return scanstring(raw + '"', 0)[0]
    except json.JSONDecodeError:
        return None  # json.loads of the skeleton refuses the line


def text_of_line(
    chunks: Iterable[str], field: str, check: Callable[[LineParser], None]
) -> Iterator[str]:
    """The text field's content of one JSON line given in chunks; at the end `check(parser)`
    refuses what json.loads and the reading rules refuse (see `LineParser.finish`)."""
    parser = LineParser(field)
    for chunk in chunks:
        yield from parser.feed(chunk)
    check(parser)
