"""A chat rendering (or a prompt or completion) to token ids and a loss mask, tokenized in
pieces (`prepare --format chat|prompt_completion`).

Tokenizing a whole rendering in one call, with its offsets, costs a worker about 130 to
280 bytes per character (the tokenizer's alignments and, in Python, a list of ids and one
of offset tuples): one 16 MB conversation took 4.5 GB. Here the rendering is cut where the
tokenizer cannot merge across (`long_docs.Cutter`, the places and checks of long text
documents), the pieces are encoded BATCH_CHARS at a time with the tokenizer's backend, and
each piece's ids and character offsets are kept as numpy arrays (8 and 8 bytes per token).
The ids are those of `tok(text, add_special_tokens=False)`, what `apply_chat_template`
tokenizes; a token's offsets lie in its piece, so they are the whole encoding's too.

Masks, by character spans of the rendering:
- `located_mask`: the tokens whose first character is in a span (the assistant turns found
  by `instructions._assistant_span`);
- `generation_mask`: transformers' `return_assistant_tokens_mask` rule for the spans of
  `{% generation %}` blocks: from the token holding a span's first character to the one
  holding its last (the first token holding each), all of them when the last is in none,
  and no further span once a first character is in no token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from moetrain.prepare import long_docs
from moetrain.prepare.encode import BATCH_CHARS


class Tokens:
    """The ids and character offsets of a text, piece by piece (see the module's doc)."""

    def __init__(self, tok: Any, text: str, where: Callable[[], str]) -> None:
        # The `tokenizers.Tokenizer` that a transformers tokenizer's tok() calls (or one).
        backend = getattr(tok, "backend_tokenizer", tok)
        self.bases: list[int] = []  # each piece's first character in the text
        self.firsts: list[int] = []  # each piece's first token in the ids
        self.ids: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []  # offsets in the text, per piece
        self.ends: list[np.ndarray] = []
        batch: list[str] = []
        at, count = 0, 0

        def encode() -> None:
            nonlocal batch, at, count
            for piece, enc in zip(batch, backend.encode_batch(batch, add_special_tokens=False)):
                # int32: a line of instruction data is far below 2**31 characters.
                offsets = np.asarray(enc.offsets, dtype=np.int32).reshape(-1, 2) + at
                self.bases.append(at)
                self.firsts.append(count)
                self.ids.append(np.asarray(enc.ids, dtype=np.int64))
                self.starts.append(offsets[:, 0].copy())
                self.ends.append(offsets[:, 1].copy())
                at, count = at + len(piece), count + len(enc.ids)
            batch = []

        cutter = long_docs.Cutter(long_docs.Joins(backend).joins, where)
        step = long_docs.PIECE_CHARS
        chars = 0
        for i in range(0, len(text), step):  # pushed a piece's worth at a time, as a stream
            for piece in cutter.push(text[i : i + step]):
                batch.append(piece)
                chars += len(piece)
                if chars >= BATCH_CHARS:
                    encode()
                    chars = 0
        batch.append(cutter.rest())
        encode()
        self.count = count

    def all_ids(self) -> np.ndarray:
        return np.concatenate(self.ids)

    def located_mask(self, spans: list[tuple[int, int]]) -> np.ndarray:
        """uint8 [T]: 1 for the tokens whose first character is in one of `spans`."""
        inside = [np.zeros(len(s), dtype=bool) for s in self.starts]
        for a, b in spans:
            for i in self._pieces(a, b):
                inside[i] |= (self.starts[i] >= a) & (self.starts[i] < b)
        return np.concatenate(inside).astype(np.uint8)

    def generation_mask(self, spans: list[tuple[int, int]]) -> np.ndarray:
        """uint8 [T]: transformers' assistant mask of `{% generation %}` spans (the doc)."""
        mask = np.zeros(self.count, dtype=np.uint8)
        for a, b in spans:
            first, last = self._token_at(a), self._token_at(b - 1)
            if first is None:
                break  # as transformers: a span out of the tokens ends the marking
            mask[first : self.count if last is None else last + 1] = 1
        return mask

    def tokens_before(self, char: int) -> int:
        """How many tokens begin before character `char`: where a document that keeps the
        text before `char` ends (`prepare --truncate`)."""
        i = max(0, int(np.searchsorted(self.bases, char, side="right")) - 1)
        if i >= len(self.starts):
            return self.count
        return self.firsts[i] + int(np.searchsorted(self.starts[i], char, side="left"))

    def _pieces(self, a: int, b: int) -> range:
        """The pieces that characters [a, b) fall in."""
        lo = max(0, int(np.searchsorted(self.bases, a, side="right")) - 1)
        return range(lo, int(np.searchsorted(self.bases, b, side="left")))

    def _token_at(self, char: int) -> int | None:
        """The first token whose offsets hold character `char` (None: none does)."""
        i = max(0, int(np.searchsorted(self.bases, char, side="right")) - 1)
        if i >= len(self.starts):
            return None
        hit = np.flatnonzero((self.starts[i] <= char) & (char < self.ends[i]))
        return self.firsts[i] + int(hit[0]) if len(hit) else None
