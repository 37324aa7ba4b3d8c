"""`prepare --truncate SEQ_LEN`: documents made to fit a sample of `data.seq_len = SEQ_LEN`
(SEQ_LEN tokens and the EOS after them), at prepare time, where a document's turns are known.

Training packs instruction data (a corpus with a loss mask) as whole documents and leaves
out one longer than a sample (moetrain/data/conversations.py): the default here too, nothing
is cut. With --truncate:

- a conversation keeps its turns from the start up to the end of the last trained answer
  that fits whole (its end-of-turn text or stop target included); an answer is never cut,
  and what follows it is left out. A document whose first trained answer does not fit (a
  prompt/completion pair whose completion does not: its stop target is the EOS) is left
  out and counted. The EOS after a cut document is no target: its last answer has its own.
- a text document is cut after SEQ_LEN tokens (the rest of it is not prepared).

Torch-free: it runs in worker processes. What a unit cut and left out goes into its done
marker (`Cuts.fields`), so that a resumed prepare reports reused units' too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# (ids, mask, EOS a target, where its trained answers end): moetrain/prepare/instructions.py
Rendered = tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]


@dataclass
class Cuts:
    """What one unit's --truncate did."""

    truncated: int = 0  # documents cut to fit
    dropped: int = 0  # documents left out: not even their first answer fits

    def fields(self) -> dict[str, Any]:
        """What a done marker records (nothing when nothing was cut)."""
        found = {"truncated_documents": self.truncated, "dropped_documents": self.dropped}
        return {k: v for k, v in found.items() if v}


def fit_instruction(
    docs: list[Rendered], seq_len: int | None, cuts: Cuts
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The documents as the shard writes them (ids, mask, EOS a target), each longer than
    `seq_len` tokens cut after its last answer that fits, or left out (see the module)."""
    kept = []
    for ids, mask, eos, answer_ends in docs:
        if seq_len is None or len(ids) <= seq_len:
            kept.append((ids, mask, eos))
            continue
        fits = [end for end in answer_ends if 0 < end <= seq_len]
        if not fits:
            cuts.dropped += 1
            continue
        end = max(fits)
        kept.append((ids[:end], mask[:end], 0))
        cuts.truncated += 1
    return kept


def fit_text(
    flat: np.ndarray, lengths: np.ndarray, seq_len: int | None, cuts: Cuts
) -> tuple[np.ndarray, np.ndarray]:
    """Text documents (their ids concatenated in `flat`) each cut after `seq_len` tokens."""
    if seq_len is None or not len(lengths) or int(lengths.max()) <= seq_len:
        return flat, lengths
    starts = np.cumsum(lengths) - lengths
    kept = np.minimum(lengths, seq_len)
    flat = np.concatenate([flat[s : s + n] for s, n in zip(starts, kept, strict=True)])
    cuts.truncated += int((lengths > seq_len).sum())
    return flat, kept
