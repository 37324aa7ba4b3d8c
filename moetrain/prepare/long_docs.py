"""Long documents in `python -m moetrain.prepare`: tokenized in pieces and written in parts, so
that a worker's memory does not grow with the longest document.

A document of more than STREAM_BYTES (a JSON line, or a text file) comes from the reader as
a `reader.TextStream`: its text in chunks, never whole (moetrain/data/reader.py). Its text is
cut into pieces of about PIECE_CHARS, encoded BATCH_CHARS at a time, and each piece's ids go
to the shard as they come (`ShardWriter.add_part`); the document's EOS and end offset once, at
its end. Shorter documents keep the batched path (moetrain/prepare/worker.py).

The ids must be those of the whole document, `Tokenizer.encode(text).ids`, so a piece ends
only where the tokenizer cannot merge across. BPE, WordPiece and Unigram tokenize each
pre-token apart; what can join across a place is the normalizer, the pre-tokenizer's regex
(GPT-style ones glue ".\\n\\n" or "\\s*[\\r\\n]+" runs; `\\s+(?!\\S)` depends on what follows), a
prefix added at the start of every input (ByteLevel's add_prefix_space, Metaspace's
prepend_scheme) and added tokens. So a place is a candidate only between non-whitespace and
a lone "\\n" or " ", or between a word and punctuation or a letter and a digit; and it is used
only if, on CHECK_CHARS of text each side of it, (1) encoding both sides in one call gives
the ids of the two sides encoded apart, and (2) the normalizer maps the two sides apart and
the pre-tokenizer splits there, or else (no pre-tokenizer, or one that does not split there,
e.g. Metaspace(split=False)) the model is BPE or Unigram and no token of the vocabulary holds
the two characters on either side: such a model cannot make a token across. (2) is what
makes (1) hold beyond the window: a pre-token longer than the window would be cut by its
edge and hide merges across the place. A failed check tries the next candidate.

NOTE: where no candidate passes (text without whitespace or punctuation, or a tokenizer that
changes every input's start: a Prepend normalizer, as Llama-2's older tokenizer.json), the
piece grows until one does, and tokenizing it takes memory with its size (about 130 bytes per
character with a 32k BPE tokenizer.json): exact ids first. Past WARN_CHARS a warning on
stderr names the document. The byte tokenizer cuts anywhere.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from moetrain.data.reader import TextStream
from moetrain.prepare.encode import BATCH_CHARS, encode_or_explain, encoder_of

STREAM_BYTES = 1 << 20  # a longer JSON line or text file is streamed (bytes as read)
PIECE_CHARS = 1 << 18  # text per piece of a streamed document (about)
CHECK_CHARS = 1 << 12  # text on each side of a cut that its check encodes
TRIES = 3  # candidates of one kind checked before the next kind
WARN_CHARS = 1 << 21  # text without a cut that makes a warning (~270 MB to tokenize)

# Candidate cuts, by kind: after a lone "\n" between non-whitespace; before a lone " " after
# non-whitespace; between a word character and punctuation, or a letter and a digit.
CANDIDATES = (
    re.compile(r"(?<=\S\n)(?=\S)"),
    re.compile(r"(?<=\S)(?= \S)"),
    re.compile(r"(?<=\w)(?=[^\w\s])|(?<=[^\w\s])(?=\w)|(?<=[^\W\d])(?=\d)|(?<=\d)(?=[^\W\d])"),
)

Report = Callable[[int, int, int, bool], None]  # unit_files.Report


class Joins:
    """Where a `tokenizers.Tokenizer` cannot merge across: `joins(left, right)`."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab: list[str] | None = None  # read on first use
        self.spans: dict[str, bool] = {}  # two characters -> whether a token holds them

    def joins(self, left: str, right: str) -> bool:
        """Whether encoding left + right gives the ids of left then right, because the place
        between them separates pre-tokens, or no token of the vocabulary can span it."""
        both, a, b = self.tok.encode_batch([left + right, left, right], add_special_tokens=False)
        return both.ids == a.ids + b.ids and self._apart(left, right)

    def _apart(self, left: str, right: str) -> bool:
        # NOTE: equal ids in the window are not enough: a pre-token longer than the window
        # (a long word) is cut by its edge, and its merges across the place never show.
        norm, pre = self.tok.normalizer, self.tok.pre_tokenizer
        if norm is not None:
            whole, left, right = (norm.normalize_str(t) for t in (left + right, left, right))
            if whole != left + right:
                return False
        split = pre.pre_tokenize_str if pre is not None else lambda t: [(t, (0, len(t)))]
        if not any(a < len(left) < b for _, (a, b) in split(left + right)):
            return True
        # Within one pre-token (a pre-tokenizer that does not split there): BPE's merges and
        # Unigram's pieces make tokens of the vocabulary, so none can span two characters
        # that no token holds side by side.
        ends, starts = split(left), split(right)
        if type(self.tok.model).__name__ not in ("BPE", "Unigram") or not ends or not starts:
            return False
        pair = ends[-1][0][-1:] + starts[0][0][:1]
        if pair not in self.spans:
            if self.vocab is None:
                self.vocab = list(self.tok.get_vocab(with_added_tokens=False))
            self.spans[pair] = any(pair in token for token in self.vocab)
        return not self.spans[pair]


class Cutter:
    """Cuts text pushed in chunks into pieces at checked places (see the module's doc)."""

    def __init__(self, joins: Callable[[str, str], bool], where: Callable[[], str]) -> None:
        self.joins, self.where = joins, where
        self.parts: list[str] = []  # the piece's text before `tail`: no cut found in it
        self.held = 0  # characters in parts
        self.tail = ""  # the rest of the text not yet cut off
        self.lo = 0  # candidates before tail[lo] were tried (or are only context)
        self.kinds = list(CANDIDATES)  # the kind that last passed first
        self.warned = False

    def push(self, text: str) -> Iterator[str]:
        """The pieces that `text` completes."""
        self.tail += text
        while self.held + len(self.tail) >= PIECE_CHARS + CHECK_CHARS:
            start = max(self.lo, CHECK_CHARS, PIECE_CHARS - self.held)
            stop = len(self.tail) - CHECK_CHARS
            if start >= stop:
                return
            cut = self._find(start, stop)
            if cut is None:  # keep only what later candidates need as context
                keep = stop - CHECK_CHARS
                self.parts.append(self.tail[:keep])
                self.held += keep
                self.tail, self.lo = self.tail[keep:], CHECK_CHARS
                self._warn()
                return
            yield "".join(self.parts) + self.tail[:cut] if self.parts else self.tail[:cut]
            self.parts, self.held = [], 0
            self.tail, self.lo = self.tail[cut:], 0

    def rest(self) -> str:
        """The last piece."""
        return "".join([*self.parts, self.tail])

    def _find(self, start: int, stop: int) -> int | None:
        for kind in self.kinds:
            for tried, match in enumerate(kind.finditer(self.tail, start, stop)):
                if tried == TRIES:
                    break
                i = match.start()
                if self.joins(self.tail[i - CHECK_CHARS : i], self.tail[i : i + CHECK_CHARS]):
                    self.kinds.remove(kind)
                    self.kinds.insert(0, kind)
                    return i
        return None

    def _warn(self) -> None:
        if self.held > WARN_CHARS and not self.warned:
            self.warned = True
            print(
                f"warning: {self.where()}: no place to cut this document where the tokenizer "
                f"cannot merge across in {self.held / 1e6:,.0f}M characters (text without "
                "whitespace or punctuation, or a tokenizer that does not split at them): it "
                "is tokenized in one piece until one is found, and the worker's memory grows "
                "with that piece (the ids stay exact)",
                file=sys.stderr,
                flush=True,
            )


def write(
    stream: TextStream,
    writer: Any,
    tok: Any,
    report: Report,
    alive: Callable[[], bool],
    keep: int | None = None,
) -> bool:
    """Tokenize a streamed document in pieces and append it to `writer` (a unit_files.ShardWriter)
    in parts, then its EOS; nothing for an empty one. Progress goes to `report` as it goes.
    `keep` (`prepare --truncate`): only its first `keep` tokens (the ids of whole-document
    encoding: pieces end where the tokenizer cannot merge across); True when it was cut."""
    encode = encoder_of(tok)
    cutter = None if tok is None else Cutter(Joins(tok).joins, stream.where)
    batch: list[str] = []
    chars, empty, written, cut = 0, True, 0, False

    def flush() -> None:
        nonlocal batch, chars, written, cut
        flat, lengths = encode_or_explain(encode, batch, stream.where)
        for ids in np.split(flat, np.cumsum(lengths)[:-1]):  # one part per piece
            if keep is not None and written + len(ids) > keep:
                ids, cut = ids[: keep - written], True
            writer.add_part(ids)
            written += len(ids)
        report(0, 0, len(flat), True)
        batch, chars = [], 0
        if not alive():
            raise SystemExit(1)  # the main process is gone: stop, leave no marker

    for text in stream:  # read to its end, as a TextStream must be, even once it is cut
        empty = empty and not text
        if cut or (keep is not None and written >= keep and text):
            cut = True  # full: the rest is read, not tokenized
            continue
        for piece in [text] if cutter is None else cutter.push(text):
            batch.append(piece)
            chars += len(piece)
            # Cut short, it may be full after a piece: encoding a batch more would be waste.
            if chars >= BATCH_CHARS or (keep is not None and chars >= keep):
                flush()
    if empty:
        return False
    if cutter is not None and not cut:
        batch.append(cutter.rest())
    if batch:
        flush()
    report(0, 1, writer.add(np.empty(0, np.int64), np.zeros(1, np.int64)), True)  # its EOS
    return cut
