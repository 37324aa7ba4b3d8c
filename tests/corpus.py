"""Test helpers that build the data path's objects the way a run does, for unit tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moetrain.config import DataSection
from moetrain.data.corpus import open_corpus
from moetrain.data.packing import PackedDataset, pack_corpus
from moetrain.data.tokenizers import Tokenizer


def pack_documents(
    documents: Iterable[str], tokenizer: Tokenizer, max_tokens: int | None = None
) -> torch.Tensor:
    """`pack_corpus`'s flat token stream as an int32 tensor."""
    return torch.from_numpy(pack_corpus(documents, tokenizer, max_tokens)[0])


def build_dataset(
    cfg: DataSection, tokenizer: Tokenizer, vocab_size: int | None = None, corpora=None
) -> PackedDataset:
    """Fixed-length samples of the configured source, as a run opens them."""
    stream, summary, _ = open_corpus(cfg, tokenizer, vocab_size, corpora=corpora)
    return PackedDataset(stream, cfg.seq_len, tokenizer.eos_id, summary, cfg.reset_positions)
