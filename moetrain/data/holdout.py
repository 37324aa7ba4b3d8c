"""`eval.fraction`: whole documents of the training corpus held out for evaluation.

Document d (the d-th non-empty document of the corpus, counted from 0, in the order both
the in-memory sources and `prepare` read it) is held out when

    z = (d + 0x9E3779B97F4A7C15) mod 2^64        # SplitMix64's first output for seed d
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
    z = z ^ (z >> 31)
    held out  <=>  z < min(floor(fraction * 2^64), 2^64 - 1)   (fraction * 2^64 in float64)

a function of the document's index alone, so the same documents are held out for every
layout, seed and number of workers, and a prepared corpus and the same corpus read in
memory hold out the same ones; a smaller fraction holds out a subset. Training sees the
other documents, concatenated as usual; evaluation sees the held-out ones. With
`data.max_tokens`, both come from the documents read before the training stream reached it.

NOTE: until 2026-11-27 the hash was the same mix of d * 0x9E3779B97F4A7C15, which is 0 for
d = 0: document 0 was held out at every fraction. `HOLDOUT_HASH` names the scheme in a
checkpoint's data identity, and a checkpoint of the old one is refused by name
(`moetrain.checkpoint.resume`).

Prepared corpora are filtered as they are read (`DocumentView`): start-up reads each shard's
document table once (8 bytes per document) and keeps one count per shard; a shard's table of
selected documents is rebuilt when a sample needs it (a few are cached).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict

import numpy as np

from moetrain.data.prepared import PreparedCorpus
from moetrain.data.shards import ShardedTokens

# The scheme a checkpoint's data identity records (absent: the old d * golden mix).
HOLDOUT_HASH = "splitmix64(d)"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(seeds: np.ndarray) -> np.ndarray:
    """SplitMix64's first output for each seed (uint64 arithmetic wraps modulo 2^64)."""
    z = seeds.astype(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def held_out(doc_indices: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each document (by index) is held out: splitmix64(d) < fraction * 2^64."""
    threshold = np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    with np.errstate(over="ignore"):
        return splitmix64(doc_indices) < threshold


class DocumentView:
    """The documents of a prepared corpus that a hold-out keeps (`evaluation=False`: the
    training side) or holds out (`True`), concatenated: a TokenStream like ShardedTokens.

    `max_tokens` caps the training side; the held-out side then keeps only the documents
    before the one where the training side reached it (`cut`)."""

    def __init__(
        self,
        corpus: PreparedCorpus,
        tokens: ShardedTokens,
        fraction: float,
        evaluation: bool,
        max_tokens: int | None = None,
        cut: int | None = None,
    ) -> None:
        self.corpus, self.tokens = corpus, tokens
        self.fraction, self.evaluation = fraction, evaluation
        self._docs_start = np.cumsum([0, *corpus.shard_documents()]).tolist()
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.cut = cut  # global document index: documents from here on are not read
        totals, documents = [], 0
        for i in range(len(self._docs_start) - 1):
            starts, ends = self._selected(i)
            sizes = ends - starts
            totals.append(int(sizes.sum()))
            documents += len(sizes)
            if max_tokens is not None and not evaluation and sum(totals) >= max_tokens:
                # The document that reaches the cap is the last one read.
                before = sum(totals) - totals[-1]
                last = int(np.searchsorted(np.cumsum(sizes), max_tokens - before))
                last = min(last, len(sizes) - 1)
                picked = np.flatnonzero(self._mask(i))
                self.cut = self._docs_start[i] + int(picked[last]) + 1
                documents -= len(sizes) - (last + 1)  # the ones after it are not read
                break
        self.starts = np.cumsum([0] + totals).tolist()  # view position where shard i begins
        self.documents = documents
        self.length = self.starts[-1] if max_tokens is None else min(max_tokens, self.starts[-1])

    def _mask(self, i: int) -> np.ndarray:
        first, last = self._docs_start[i], self._docs_start[i + 1]
        if self.cut is not None:
            last = max(first, min(last, self.cut))
        count = self._docs_start[i + 1] - first
        mask = held_out(np.arange(first, first + count), self.fraction) == self.evaluation
        mask[last - first :] = False
        return mask

    def _selected(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw [start, end) token offsets in shard i of its selected documents."""
        ends = self.corpus.shard_document_ends(i)
        starts = np.concatenate([[0], ends[:-1]])
        mask = self._mask(i)
        return starts[mask], ends[mask]

    def _table(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard i's selected documents: raw starts, and view offsets where each begins."""
        if i not in self._cache:
            starts, ends = self._selected(i)
            self._cache[i] = (starts, np.cumsum(np.concatenate([[0], ends - starts])))
            if len(self._cache) > 8:
                self._cache.popitem(last=False)
        self._cache.move_to_end(i)
        return self._cache[i]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("DocumentView supports contiguous slices only")
        pieces, pos = [], start
        while pos < stop:
            i = bisect_right(self.starts, pos) - 1
            raw_starts, offsets = self._table(i)
            local = pos - self.starts[i]
            j = int(np.searchsorted(offsets, local, side="right")) - 1  # the document at pos
            take = min(stop - pos, int(offsets[j + 1]) - local)
            raw = int(raw_starts[j]) + local - int(offsets[j])
            pieces.append(self.tokens.read(i, raw, raw + take))
            pos += take
        if not pieces:
            return np.empty(0, dtype=self.tokens.dtype)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def ends_within(self, start: int, stop: int) -> np.ndarray:
        """As `ShardedTokens.ends_within`, in this view's positions."""
        found = []
        stop = min(stop, self.length)
        i = max(bisect_right(self.starts, start) - 1, 0)
        while i < len(self.starts) - 1 and self.starts[i] < stop:
            ends = self._table(i)[1][1:] + self.starts[i]
            found.append(ends[(ends > start) & (ends <= stop)])
            i += 1
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": OrderedDict()}
