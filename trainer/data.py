"""Training data: tokenizers, document sources, sequence packing and the global sample order.

Everything is held in memory and kept deliberately simple:

    source (documents as str) -> tokenizer -> one flat token tensor, EOS after each document
    -> PackedDataset (sample i = tokens[i * seq_len : i * seq_len + seq_len + 1])
    -> GlobalBatchSampler (which samples each rank reads at each step) -> StatefulDataLoader

The sample order depends only on (seed, num_samples, global_batch_size), never on the number of
data-parallel ranks or the micro-batch size, so a run can resume on another layout at a step
boundary and still see exactly the samples it would have seen.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.config import DataSection, TrainSection

# Label value that the loss ignores (torch.nn.functional.cross_entropy's default ignore_index).
# Nothing is masked yet; kept here so document masking can use the same constant later.
IGNORE_INDEX = -100


class DataError(Exception):
    """A data configuration or data content problem, worded for the person writing the config."""


# ---------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> Sequence[int] | np.ndarray: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is EOS: needs no vocabulary file."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        # One C-level conversion instead of a Python loop per byte.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class HFTokenizer:
    """A `tokenizers` tokenizer.json (as shipped with most Hugging Face models)."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _RawTokenizer
        except ImportError as e:
            raise DataError(
                "data.tokenizer names a tokenizer.json, which needs the `tokenizers` package "
                "(pip install tokenizers)"
            ) from e
        path = Path(path)
        if path.is_dir():  # a model directory: use the tokenizer.json inside it
            path = path / "tokenizer.json"
        self.path = path
        self._tok = _RawTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int:
        if eos_token is not None:
            eos_id = self._tok.token_to_id(eos_token)
            if eos_id is None:
                raise DataError(f"data.eos_token={eos_token!r} is not in tokenizer {self.path}")
            return eos_id
        for name in COMMON_EOS_TOKENS:
            eos_id = self._tok.token_to_id(name)
            if eos_id is not None:
                return eos_id
        raise DataError(
            f"tokenizer {self.path} has none of the usual EOS tokens {COMMON_EOS_TOKENS}; "
            "set data.eos_token to the token that ends a document"
        )

    # Special tokens (e.g. a BOS added by a post-processor) are left out: packing adds the
    # one separator we want, EOS, after every document.
    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The Rust side tokenizes a batch on several threads: much faster than one by one.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(data_cfg: DataSection) -> Tokenizer:
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    if not os.path.exists(os.path.expanduser(data_cfg.tokenizer)):
        raise DataError(
            f"data.tokenizer={data_cfg.tokenizer!r} is neither 'byte' nor an existing "
            "tokenizer.json (or a directory holding one)"
        )
    return HFTokenizer(os.path.expanduser(data_cfg.tokenizer), data_cfg.eos_token)


# ---------------------------------------------------------------------------------------------
# Document sources: each yields documents (str) in an order that depends only on the files.

# Test suites are huge, repetitive and partly in odd encodings; site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted by path relative to the stdlib root."""
    root = Path(os.__file__).resolve().parent
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: str | os.PathLike) -> str:
    # A stray invalid byte should not stop a training run.
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _glob_files(pattern: str | None, source: str, what: str) -> list[str]:
    if not pattern:
        raise DataError(f"data.source={source!r} needs data.path: a glob of {what}")
    expanded = os.path.expanduser(pattern)
    files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not files:
        hint = ""
        if os.path.isdir(expanded):
            hint = f" ({expanded!r} is a directory; try '{expanded.rstrip('/')}/**/*')"
        raise DataError(
            f"data.path={pattern!r} matched no files (looked for {what} matching that glob, "
            f"relative to {os.getcwd()!r} unless absolute){hint}"
        )
    return files


def _jsonl_documents(files: list[str], field: str) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{lineno}: not valid JSON ({e})") from e
                if not isinstance(record, dict) or field not in record:
                    raise DataError(
                        f"{file}:{lineno}: no field {field!r} in this line (data.text_field)"
                    )
                text = record[field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{file}:{lineno}: field {field!r} is {type(text).__name__}, not a string"
                    )
                yield text


def _hf_documents(path: str | None, split: str, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            "data.source='hf_datasets' needs the optional `datasets` package (pip install datasets)"
        ) from e
    if not path:
        raise DataError("data.source='hf_datasets' needs data.path: a dataset name or directory")
    local = os.path.expanduser(path)
    saved_markers = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, m)) for m in saved_markers):
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.path={path!r} has splits {list(ds)}, not {split!r}")
            ds = ds[split]
    elif local.startswith(("/", ".", "~")) and not os.path.exists(local):
        raise DataError(f"data.path={path!r} does not exist (looked for a dataset directory)")
    else:
        try:
            ds = datasets.load_dataset(local, split=split)
        except Exception as e:  # datasets raises many kinds; all mean the same to the user
            raise DataError(
                f"datasets.load_dataset(data.path={path!r}, split={split!r}) failed: {e}"
            ) from e
    if field not in ds.column_names:
        raise DataError(f"data.path={path!r} has columns {ds.column_names}, no {field!r}")

    def documents() -> Iterator[str]:
        # Column batches are much faster to read than one row dict at a time.
        for batch in ds.select_columns([field]).iter(batch_size=1024):
            yield from (text for text in batch[field] if text)

    return documents()


def iter_documents(data_cfg: DataSection) -> Iterator[str]:
    """Documents of the configured source. Path problems are raised here, not on first read."""
    source = data_cfg.source
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(f"found no .py files next to {os.__file__} for data.source='stdlib'")
        return (_read_text(f) for f in files)
    if source == "text":
        return (_read_text(f) for f in _glob_files(data_cfg.path, source, "text files"))
    if source == "jsonl":
        files = _glob_files(data_cfg.path, source, "JSON-lines files")
        return _jsonl_documents(files, data_cfg.text_field)
    if source == "hf_datasets":
        return _hf_documents(data_cfg.path, data_cfg.hf_split, data_cfg.text_field)
    raise DataError(f"unknown data.source={source!r}; use stdlib, text, jsonl or hf_datasets")


# ---------------------------------------------------------------------------------------------
# Packing


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


def pack_documents(
    documents: Iterable[str], tokenizer: Tokenizer, max_tokens: int | None = None
) -> torch.Tensor:
    """All documents' tokens, each document followed by EOS, as one flat int32 tensor.

    Reading stops as soon as `max_tokens` tokens are available (the last document is cut).
    int32 halves the memory of int64 and holds any real vocabulary.
    """
    pieces: list[np.ndarray] = []
    total = 0
    for ids in _encoded(documents, tokenizer):
        pieces.append(ids)
        total += len(ids) + 1
        if max_tokens is not None and total >= max_tokens:
            break
    flat = np.empty(total, dtype=np.int32)
    pos = 0
    for ids in pieces:
        flat[pos : pos + len(ids)] = ids
        flat[pos + len(ids)] = tokenizer.eos_id
        pos += len(ids) + 1
    if max_tokens is not None:
        flat = flat[:max_tokens]
    return torch.from_numpy(flat)


class PackedDataset(Dataset):
    """Fixed-length samples cut from the flat token stream; sample i starts at i * seq_len.

    Consecutive samples overlap by one token so that every token is a label exactly once.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, eos_id: int):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.num_samples = (tokens.numel() - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"the data source gave {tokens.numel()} tokens, but data.seq_len={seq_len} needs "
                f"at least {seq_len + 1} for one sample (add data, raise data.max_tokens or "
                "lower data.seq_len)"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        input_ids = chunk[:-1]
        is_eos = (input_ids == self.eos_id).to(torch.int64)
        # A token belongs to the document whose EOS count precedes it; the EOS itself still
        # belongs to the document it ends. Numbering restarts at 0 in every sample.
        document_ids = torch.cumsum(is_eos, 0) - is_eos
        return {
            "input_ids": input_ids,
            "labels": chunk[1:],
            "position_ids": torch.arange(self.seq_len, dtype=torch.int64),
            "document_ids": document_ids,
        }


def build_dataset(data_cfg: DataSection, tokenizer: Tokenizer) -> PackedDataset:
    if data_cfg.max_tokens is not None and data_cfg.max_tokens < 1:
        raise DataError(f"data.max_tokens must be >= 1 or unset, got {data_cfg.max_tokens}")
    tokens = pack_documents(iter_documents(data_cfg), tokenizer, data_cfg.max_tokens)
    return PackedDataset(tokens, data_cfg.seq_len, tokenizer.eos_id)


# ---------------------------------------------------------------------------------------------
# Global sample order


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step."""
    if global_batch_size < 1 or micro_batch_size < 1 or dp_size < 1:
        raise DataError(
            f"train.global_batch_size ({global_batch_size}), train.micro_batch_size "
            f"({micro_batch_size}) and the data-parallel size ({dp_size}) must all be >= 1"
        )
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise DataError(
            f"train.global_batch_size={global_batch_size} must be divisible by "
            f"train.micro_batch_size ({micro_batch_size}) x data-parallel ranks ({dp_size}) = "
            f"{per_step}, so each rank runs a whole number of micro-batches per step; "
            f"e.g. use global_batch_size={max(per_step, global_batch_size // per_step * per_step)}"
        )
    return global_batch_size // per_step


def _epoch_seed(seed: int, epoch: int) -> int:
    # torch's CPU generator keeps only the low 32 bits of its seed, so packing (seed, epoch)
    # into high and low bits would silently drop the seed: hash the pair instead.
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0xFFFF_FFFF


class GlobalBatchSampler:
    """Yields this rank's micro-batches (lists of dataset indices), forever.

    The sample stream is epoch 0's order, then epoch 1's, ...; with shuffle, epoch e's order is
    randperm(num_samples) seeded by (seed, e). Step s owns stream positions [s*G, (s+1)*G); rank
    r reads the contiguous slice [r*G/dp, (r+1)*G/dp) of it in micro-batches, in order. Hence
    the samples of a step are the same set for every data-parallel layout.

    All progress lives on this object (not in an iterator), because StatefulDataLoader saves
    and restores the batch sampler itself and then calls iter() on it again.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ):
        self.grad_accum = grad_accum_steps(global_batch_size, micro_batch_size, dp_size)
        if num_samples < 1:
            raise DataError(f"need at least one sample, got num_samples={num_samples}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0  # global samples of all completed steps
        self.micro_batches_into_step = 0  # micro-batches this rank has read of the current step
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    @property
    def step(self) -> int:
        """Index of the step the next micro-batch belongs to (while G stays the same)."""
        return self.consumed_samples // self.global_batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Dataset indices in the order epoch `epoch` visits them (the last one is cached)."""
        if epoch != self._order_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._order = torch.randperm(self.num_samples, generator=gen)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def sample_at(self, position: int) -> int:
        """Dataset index at a position of the infinite global stream."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self.epoch_order(epoch)[offset])

    def next_micro_batch(self) -> list[int]:
        per_rank = self.global_batch_size // self.dp_size
        start = (
            self.consumed_samples
            + self.dp_rank * per_rank
            + self.micro_batches_into_step * self.micro_batch_size
        )
        batch = [self.sample_at(p) for p in range(start, start + self.micro_batch_size)]
        self.micro_batches_into_step += 1
        if self.micro_batches_into_step == self.grad_accum:
            self.consumed_samples += self.global_batch_size
            self.micro_batches_into_step = 0
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_micro_batch()

    def _layout(self) -> dict[str, int]:
        return {
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def state_dict(self) -> dict[str, Any]:
        # At a step boundary nothing here depends on dp_rank, dp_size or the micro-batch size.
        # Mid-step, the position only makes sense for the same layout, which is recorded.
        mid_step = self.micro_batches_into_step > 0
        return {
            "consumed_samples": self.consumed_samples,
            "micro_batches_into_step": self.micro_batches_into_step,
            "mid_step_layout": self._layout() if mid_step else None,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"the data state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; the sample order would not continue (did "
                    "the data config, its files or train.seed change?)"
                )
        k = int(state["micro_batches_into_step"])
        if k and state.get("mid_step_layout") != self._layout():
            raise DataError(
                f"the data state was saved {k} micro-batches into a step with layout "
                f"{state.get('mid_step_layout')}; resuming mid-step needs that same layout, but "
                f"this run has {self._layout()}. Resume from a step boundary to change layout."
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batches_into_step = k


# ---------------------------------------------------------------------------------------------
# Loader


def collate_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample tensors into [micro_batch_size, seq_len] tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def build_dataloader(
    data_cfg: DataSection,
    train_cfg: TrainSection,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer: Tokenizer | None = None,
) -> tuple[StatefulDataLoader, Tokenizer]:
    """This rank's infinite, resumable loader of micro-batches, and the tokenizer it used.

    Each batch is a dict of [micro_batch_size, seq_len] tensors. Call iter() once and keep the
    iterator (the stream is infinite): with workers, a new iterator drops the micro-batches the
    old one had prefetched. To resume, `loader.load_state_dict(saved)` before iterating; the
    sampler's own state is under "_index_sampler_state" (num_workers=0) or
    ["_snapshot"]["_main_snapshot"]["_index_sampler_state"] (num_workers > 0).
    """
    # Cheap config checks first, before spending time reading and tokenizing.
    grad_accum_steps(train_cfg.global_batch_size, train_cfg.micro_batch_size, dp_size)
    if tokenizer is None:
        tokenizer = build_tokenizer(data_cfg)
    dataset = build_dataset(data_cfg, tokenizer)
    sampler = GlobalBatchSampler(
        num_samples=len(dataset),
        global_batch_size=train_cfg.global_batch_size,
        micro_batch_size=train_cfg.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=train_cfg.seed,
        shuffle=data_cfg.shuffle,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that recent torch deprecated; nothing we can act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
        loader = StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=data_cfg.num_workers,
            collate_fn=collate_samples,
        )
    return loader, tokenizer


def add_mtp_targets(batch: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Multi-token prediction inputs and labels, [B, S, depth] each: at position i, depth k
    (1-based) reads token i+k and predicts token i+k+1, i.e. input_ids and labels shifted
    left by k; the last k positions have no target.

    NOTE: built on whole sequences, before any context-parallel split, so that a rank
    holding positions i gets tokens i+k that may live on another rank's part.
    """
    ids, labels = batch["input_ids"], batch["labels"]  # [B, S]
    shifted_ids, shifted_labels = [], []
    for k in range(1, depth + 1):
        shifted_ids.append(torch.nn.functional.pad(ids[:, k:], (0, k), value=0))
        shifted_labels.append(torch.nn.functional.pad(labels[:, k:], (0, k), value=IGNORE_INDEX))
    return {
        **batch,
        "mtp_input_ids": torch.stack(shifted_ids, dim=-1),
        "mtp_labels": torch.stack(shifted_labels, dim=-1),
    }
