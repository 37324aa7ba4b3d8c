"""Instruction data: prepared shards with a loss mask (`prepare --format chat|
prompt_completion`), packed into samples of whole documents.

Invariant: no sample holds part of a document, so no step trains on a conversation whose
prompt was cut off. Documents (each a conversation or a prompt/completion pair, its EOS
included) are packed in order, greedily, into windows of `data.seq_len + 1` tokens; a window
that cannot take the next document whole is closed and padded (EOS tokens, each its own
document, whose labels count nothing). A document longer than a window is left out, and
the start-up line says how many were (`prepare --truncate SEQ_LEN` cuts conversations to
whole turns that fit, at prepare time, where the turns are known). Labels are the next tokens where the mask marks them
(the assistant turns and their end-of-turn token; a completion and its EOS), the ignore
index elsewhere: the loss averages over exactly the masked-in tokens of the global batch.

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
    """Every document's length in tokens, its EOS included: int64 [docs]."""
    return np.diff(corpus.document_ends(), prepend=0)


def check_some_fit(lengths: np.ndarray, seq_len: int, where: str) -> None:
    """Refuse documents of which not one fits a sample: all would be left out (never cut),
    and the run would find no sample at all. `where` names them (the prepared directory)."""
    window = seq_len + 1
    if not len(lengths) or (lengths <= window).any():
        return
    shortest, longest = int(lengths.min()), int(lengths.max())
    every = f" ({longest - 1} keeps every one)" if longest > shortest else ""
    raise DataError(
        f"{where}: every one of its {len(lengths):,} documents (conversations or prompt/"
        f"completion pairs) is longer than data.seq_len + 1 = {window} tokens (the shortest "
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
        chosen = np.ones(len(ends), dtype=bool)
        if holdout is not None:
            chosen = held_out(np.arange(len(ends)), holdout) == evaluation
        lengths = ends - starts
        if chosen.any():  # the side asked for (all, trained or held out) has documents
            check_some_fit(lengths[chosen], seq_len, corpus.path)
        fits = lengths <= seq_len + 1
        self.left_out = int((chosen & ~fits).sum())
        keep = np.flatnonzero(chosen & fits)
        if max_tokens is not None:
            keep = keep[: int(np.searchsorted(np.cumsum(lengths[keep]), max_tokens)) + 1]
        self.starts, self.lengths = starts[keep], lengths[keep].astype(np.int32)
        # Greedy packing: a sample's documents are [first[k], first[k + 1]).
        first, used = [], seq_len + 2  # no open window yet
        for d, n in enumerate(self.lengths.tolist()):
            if used + n > seq_len + 1:
                first.append(d)
                used = 0
            used += n
        self.first = np.asarray([*first, len(keep)], dtype=np.int64)
        tokens = int(self.lengths.sum())
        self.summary = CorpusSummary(
            corpus.describe("tokens with loss mask"),
            len(keep),
            tokens,
            tokens,
            truncated=max_tokens is not None and len(keep) < int((chosen & fits).sum()),
            fingerprint=fingerprint,
            left_out=self.left_out,
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
