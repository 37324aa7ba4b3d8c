"""Training data: tokenizers, document sources, sequence packing and the global sample order.

    source (documents as str) -> tokenizer -> one flat token tensor, EOS after each document
    -> PackedDataset (sample i = tokens[i * seq_len : i * seq_len + seq_len + 1], a `Batch`)
    -> GlobalBatchSampler (which samples each rank reads at each step) -> StatefulDataLoader

The sample order depends only on (seed, num_samples, global_batch_size), never on the number
of data-parallel ranks or the micro-batch size, so a run can resume on another layout at a
step boundary and still see exactly the samples it would have seen.
"""

from trainer.data.batch import IGNORE_INDEX, Batch, DataError
from trainer.data.corpus import build_dataset, check_corpus, open_corpus
from trainer.data.loader import build_dataloader
from trainer.data.packing import (
    CorpusSummary,
    PackedDataset,
    document_positions,
    pack_corpus,
    pack_documents,
)
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.sources import iter_documents, source_files, stdlib_files
from trainer.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ByteTokenizer",
    "CorpusSummary",
    "DataError",
    "GlobalBatchSampler",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "build_dataloader",
    "build_dataset",
    "build_tokenizer",
    "check_corpus",
    "document_positions",
    "iter_documents",
    "open_corpus",
    "pack_corpus",
    "pack_documents",
    "source_files",
    "stdlib_files",
]
