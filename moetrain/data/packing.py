"""Packing: documents -> one flat token stream (EOS after each) -> fixed-length samples."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from moetrain.data.batch import Batch
from moetrain.data.holdout import held_out
from moetrain.data.tokenizers import Tokenizer
from moetrain.errors import DataError
from moetrain.models.common.visibility import document_positions


def _encoded(documents: Iterable[str], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """Token ids of each non-empty document, tokenizing in small batches where supported."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    batch: list[str] = []
    chars = 0
    for doc in documents:
        if not doc:
            continue  # would only add a lone EOS
        batch.append(doc)
        chars += len(doc)
        # Small batches keep the early stop for max_tokens from reading far ahead.
        if encode_batch is None or len(batch) >= 64 or chars >= 1 << 20:
            yield from _encode_all(tokenizer, batch)
            batch, chars = [], 0
    if batch:
        yield from _encode_all(tokenizer, batch)


def _encode_all(tokenizer: Tokenizer, texts: list[str]) -> Iterator[np.ndarray]:
    encode_batch = getattr(tokenizer, "encode_batch", None)
    encoded = encode_batch(texts) if encode_batch is not None else map(tokenizer.encode, texts)
    for ids in encoded:
        yield np.asarray(ids)


@dataclass(frozen=True)
class CorpusSummary:
    """What a run trains on, for the console line at start-up."""

    source: str  # e.g. "jsonl (3 files)" or "tokens (prepared, 12 shards)"
    documents: int
    tokens: int
    corpus_tokens: int | None  # the whole corpus' tokens, when known; None when not read
    truncated: bool  # data.max_tokens cut the corpus
    # A digest of the token stream's content (and the tokenizer's identity): a checkpoint
    # records it, and a resume on other data is refused unless asked for.
    fingerprint: str = ""
    # Documents longer than a sample, left out (instruction data never cuts one).
    left_out: int = 0
    pairs: bool = False  # preference pairs: `left_out` counts pairs, two documents each

    def describe(self, seq_len: int, samples: int) -> str:
        pairs = f" ({self.documents // 2:,} preference pairs)" if self.pairs else ""
        line = (
            f"data: {self.source}: {self.documents:,} documents{pairs}, {self.tokens:,} tokens, "
            f"{samples:,} samples of {seq_len} tokens per epoch"
        )
        if self.truncated:
            whole = f" of {self.corpus_tokens:,}" if self.corpus_tokens else ""
            line += f"; data.max_tokens cut the corpus (training on {self.tokens:,}{whole} tokens)"
        if self.left_out and self.pairs:
            line += (
                f"; {self.left_out:,} pairs longer than data.seq_len + 1 = {seq_len + 1} "
                "tokens (both sides, each with its EOS) were left out, never cut (raise "
                "data.seq_len to keep them)"
            )
        elif self.left_out:
            line += (
                f"; {self.left_out:,} documents longer than data.seq_len + 1 = {seq_len + 1} "
                "tokens were left out, never cut here (raise data.seq_len to keep them, or "
                f"prepare the corpus again with --truncate {seq_len} to keep their turns "
                "that fit)"
            )
        return line


class FlatDocuments:
    """Documents packed in memory, each followed by EOS: a TokenStream with its document
    index (`ends_within`), as prepared shards have one."""

    def __init__(self, tokens: np.ndarray, ends: np.ndarray) -> None:
        self.tokens, self.ends = tokens, ends  # int32 [tokens]; int64 [docs], ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: slice) -> np.ndarray:
        return self.tokens[index]

    def ends_within(self, start: int, stop: int) -> np.ndarray:
        """The end offsets e of the documents ending in (start, stop] (e: one past its EOS)."""
        lo, hi = np.searchsorted(self.ends, [start, min(stop, len(self))], side="right")
        return self.ends[lo:hi]


def _flatten(pieces: list[np.ndarray], eos_id: int, limit: int | None = None) -> FlatDocuments:
    """`pieces` each followed by EOS, cut after `limit` tokens."""
    flat = np.empty(sum(len(ids) + 1 for ids in pieces), dtype=np.int32)
    pos = 0
    for ids in pieces:
        flat[pos : pos + len(ids)] = ids
        flat[pos + len(ids)] = eos_id
        pos += len(ids) + 1
    ends = np.cumsum([len(ids) + 1 for ids in pieces], dtype=np.int64)
    if limit is not None:
        flat, ends = flat[:limit], ends[ends <= limit]
    return FlatDocuments(flat, ends)


def pack_corpus(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    max_tokens: int | None = None,
    holdout: float | None = None,
) -> tuple[np.ndarray, int, bool]:
    """All documents' tokens, each followed by EOS, as one flat int32 array; with the number
    of documents read and whether `max_tokens` cut the corpus.

    Reading stops as soon as `max_tokens` tokens are available (the last document is cut).
    int32 halves the memory of int64 and holds any real vocabulary. With `holdout`
    (`eval.fraction`), the held-out documents (`moetrain.data.holdout`) are left out; see
    `pack_split` for both sides.
    """
    flat, _, documents_read, truncated = pack_split(documents, tokenizer, max_tokens, holdout)
    return flat.tokens, documents_read, truncated


def pack_split(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    max_tokens: int | None = None,
    holdout: float | None = None,
) -> tuple[FlatDocuments, FlatDocuments, int, bool]:
    """(training stream, held-out stream, training documents, truncated): `pack_corpus`,
    with the documents `holdout` selects (by index, `moetrain.data.holdout.held_out`) packed
    into the second stream instead of the first."""
    kept: list[np.ndarray] = []
    held: list[np.ndarray] = []
    total, truncated = 0, False
    encoded = _encoded(documents, tokenizer)
    for index, ids in enumerate(encoded):
        if holdout is not None and held_out(np.array([index]), holdout)[0]:
            held.append(ids)
            continue
        kept.append(ids)
        total += len(ids) + 1
        if max_tokens is not None and total >= max_tokens:
            truncated = total > max_tokens or next(encoded, None) is not None
            break
    flat = _flatten(kept, tokenizer.eos_id, max_tokens)
    return flat, _flatten(held, tokenizer.eos_id), len(kept), truncated


class TokenStream(Protocol):
    """A flat token stream: its length, and contiguous slices as arrays."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> np.ndarray | torch.Tensor: ...


class PackedDataset(Dataset):
    """Fixed-length samples cut from a flat token stream; sample i starts at i * seq_len.

    Consecutive samples overlap by one token so that every token is a label exactly once.
    The stream is an in-memory array or tensor, or prepared shards read by memory map
    (`moetrain.data.shards.ShardedTokens`): a sample reads only its own seq_len + 1 tokens.
    `reset_positions`: position ids restart at 0 with each document (the token after an
    EOS, and the sample's first token); otherwise 0..seq_len-1.
    """

    def __init__(
        self,
        tokens: TokenStream,
        seq_len: int,
        eos_id: int,
        summary: CorpusSummary | None = None,
        reset_positions: bool = False,
    ):
        if isinstance(tokens, torch.Tensor | np.ndarray) and tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.summary = summary  # what the corpus holds, for the console line
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.reset_positions = reset_positions
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"the data source gave {len(tokens)} tokens, but data.seq_len={seq_len} needs "
                f"at least {seq_len + 1} for one sample (add data, raise data.max_tokens or "
                "lower data.seq_len)"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1])
        chunk = torch.from_numpy(window.astype(np.int64))  # a writable copy, as int64
        input_ids = chunk[:-1]
        ends = getattr(self.tokens, "ends_within", None)
        if ends is not None:
            # NOTE: from the document index, never from EOS ids in the tokens: a document's
            # text may hold the EOS token's text, which the tokenizer reads as that id.
            is_end = torch.zeros(self.seq_len, dtype=torch.int64)
            is_end[torch.from_numpy(ends(start, start + self.seq_len) - 1 - start)] = 1
        else:  # a stream without an index (a plain array or tensor): its EOS ids end them
            is_end = (input_ids == self.eos_id).to(torch.int64)
        # A token belongs to the document whose end count precedes it; the last token (EOS)
        # still belongs to the document it ends. Numbering restarts at 0 in every sample.
        document_ids = torch.cumsum(is_end, 0) - is_end
        # Here, before any context-parallel split: positions then travel with the tokens.
        if self.reset_positions:
            position_ids = document_positions(document_ids)
        else:
            position_ids = torch.arange(self.seq_len, dtype=torch.int64)
        return Batch(
            input_ids=input_ids,
            labels=chunk[1:],
            position_ids=position_ids,
            document_ids=document_ids,
        )
