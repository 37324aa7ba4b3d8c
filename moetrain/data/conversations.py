"""Instruction data: prepared shards with a loss mask (`prepare --format chat|
prompt_completion|preference`), packed into samples of whole documents.

Invariant: no sample holds part of a document, so no step trains on a conversation whose
prompt was cut off. Documents (each a conversation or a prompt/completion pair, its EOS
included) are packed in order, greedily, into windows of `data.seq_len + 1` tokens; a window
that cannot take the next document whole is closed and padded (EOS tokens, each its own
document, whose labels count nothing). A document longer than a window is left out, and
the start-up line says how many were (`prepare --truncate SEQ_LEN` cuts conversations to
whole turns that fit, at prepare time, where the turns are known). Labels are the next tokens where the mask marks them
(the assistant turns and their end-of-turn token; a completion and its EOS), the ignore
index elsewhere: the loss averages over exactly the masked-in tokens of the global batch.

A preference corpus is packed by pairs: a pair's two sides (chosen, rejected) are adjacent
documents of one sample, numbered 2j and 2j + 1 among its documents, never apart, so that
no micro-batch or rank holds one side of a pair; a pair is held out, kept or left out whole.

Memory: the kept documents' stream offsets and the samples' first documents, 20 bytes per
document: instruction sets are small next to pretraining corpora.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.data.holdout import held_out
from moetrain.data.packing import CorpusSummary, document_positions
from moetrain.data.prepared import PreparedCorpus
from moetrain.errors import DataError


def document_lengths(corpus: PreparedCorpus) -> np.ndarray:
    """Every document's length in tokens, its EOS included: int64 [docs]; of a preference
    corpus, every pair's (its two sides'): what a sample must hold whole."""
    lengths = np.diff(corpus.document_ends(), prepend=0)
    if corpus.manifest.preference and len(lengths) % 2 == 0:
        return lengths.reshape(-1, 2).sum(1)
    return lengths


def check_some_fit(lengths: np.ndarray, seq_len: int, where: str, pairs: bool = False) -> None:
    """Refuse documents (`pairs`: preference pairs, both sides) of which not one fits a
    sample: all would be left out (never cut), and the run would find no sample at all.
    `where` names them (the prepared directory)."""
    window = seq_len + 1
    if not len(lengths) or (lengths <= window).any():
        return
    shortest, longest = int(lengths.min()), int(lengths.max())
    every = f" ({longest - 1} keeps every one)" if longest > shortest else ""
    what = (
        "preference pairs (both sides, each with its EOS)"
        if pairs
        else "documents (conversations or prompt/completion pairs)"
    )
    raise DataError(
        f"{where}: every one of its {len(lengths):,} {what} is longer than data.seq_len + 1 = "
        f"{window} tokens (the shortest "
        f"has {shortest:,} tokens, the longest {longest:,}, EOS included), and instruction "
        "data is never cut here: all would be left out and not one sample would remain; "
        f"raise data.seq_len to at least {shortest - 1}{every}, or prepare the corpus again "
        f"with --truncate {seq_len} to keep each conversation's turns that fit"
    )


class PackedConversations(Dataset):
    """Windows of whole documents of a prepared corpus with a loss mask (see the module)."""

    def __init__(
        self,
        corpus: PreparedCorpus,
        seq_len: int,
        eos_id: int,
        reset_positions: bool,
        vocab_size: int | None = None,
        holdout: float | None = None,
        evaluation: bool = False,
        max_tokens: int | None = None,
        fingerprint: str = "",
    ) -> None:
        """With `holdout` (eval.fraction), the documents it keeps (or, `evaluation`, the ones
        it holds out); `max_tokens` stops taking documents once they hold that many tokens.
        `fingerprint`: the corpus' content digest (`CorpusSummary.fingerprint`)."""
        self.tokens = corpus.tokens(vocab_size=vocab_size)
        self.mask = corpus.masks()
        self.seq_len, self.eos_id, self.reset_positions = seq_len, eos_id, reset_positions
        ends = corpus.document_ends()
        starts = np.concatenate([[0], ends[:-1]])
        # A preference corpus packs, holds out and leaves out its pairs whole: the chosen and
        # rejected sides (documents 2k, 2k + 1) stay adjacent in one sample.
        unit = 2 if corpus.manifest.preference else 1
        self.pairs = unit == 2
        if len(ends) % unit:
            raise DataError(
                f"{corpus.path}: a preference corpus of {len(ends):,} documents, not whole "
                "pairs; prepare it again (python -m moetrain.prepare --format preference)"
            )
        lengths = ends - starts
        unit_lengths = lengths.reshape(-1, unit).sum(1)
        chosen = np.ones(len(unit_lengths), dtype=bool)
        if holdout is not None:
            chosen = held_out(np.arange(len(unit_lengths)), holdout) == evaluation
        if chosen.any():  # the side asked for (all, trained or held out) has documents
            check_some_fit(unit_lengths[chosen], seq_len, corpus.path, self.pairs)
        fits = unit_lengths <= seq_len + 1
        self.left_out = int((chosen & ~fits).sum())
        kept_units = np.flatnonzero(chosen & fits)
        if max_tokens is not None:
            taken = np.searchsorted(np.cumsum(unit_lengths[kept_units]), max_tokens) + 1
            kept_units = kept_units[: int(taken)]
        keep = (kept_units[:, None] * unit + np.arange(unit)).reshape(-1)
        self.starts, self.lengths = starts[keep], lengths[keep].astype(np.int32)
        # Greedy packing of whole units: a sample's documents are [first[k], first[k + 1]).
        first, used = [], seq_len + 2  # no open window yet
        for u, n in enumerate(unit_lengths[kept_units].tolist()):
            if used + n > seq_len + 1:
                first.append(u * unit)
                used = 0
            used += n
        self.first = np.asarray([*first, len(keep)], dtype=np.int64)
        tokens = int(self.lengths.sum())
        self.summary = CorpusSummary(
            corpus.describe("tokens with loss mask"),
            len(keep),
            tokens,
            tokens,
            truncated=max_tokens is not None and len(kept_units) < int((chosen & fits).sum()),
            fingerprint=fingerprint,
            left_out=self.left_out,
            pairs=self.pairs,
        )

    def __len__(self) -> int:
        return len(self.first) - 1

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        window = self.seq_len + 1
        ids = np.full(window, self.eos_id, dtype=np.int64)
        mask = np.zeros(window, dtype=bool)
        # NOTE: document ids from the index, never from EOS ids in the tokens: a template
        # may write the EOS token inside a conversation (DeepSeek-V3 and Mixtral end every
        # answer with it), and the conversation must stay one document.
        doc = np.zeros(window, dtype=np.int64)
        pos = 0
        for k, d in enumerate(range(int(self.first[index]), int(self.first[index + 1]))):
            a, n = int(self.starts[d]), int(self.lengths[d])
            ids[pos : pos + n] = self.tokens[a : a + n]
            mask[pos : pos + n] = self.mask[a : a + n] != 0
            doc[pos : pos + n] = k
            pos += n
        doc[pos:] = np.arange(window - pos) + (doc[pos - 1] + 1 if pos else 0)  # padding: one each
        chunk = torch.from_numpy(ids)
        input_ids = chunk[:-1]
        labels = torch.where(torch.from_numpy(mask[1:]), chunk[1:], IGNORE_INDEX)
        document_ids = torch.from_numpy(doc[:-1])
        if self.reset_positions:
            position_ids = document_positions(document_ids)
        else:
            position_ids = torch.arange(self.seq_len, dtype=torch.int64)
        return Batch(input_ids, labels, position_ids, document_ids)
