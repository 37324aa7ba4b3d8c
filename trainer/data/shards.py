"""Prepared token shards: the on-disk format, and a reader that touches only what it reads.

`python -m trainer.prepare` writes a directory:

    manifest.json          written last (atomically): its presence means complete
    shard-00000.tokens     token ids, little-endian uint16 (vocab <= 65536) or uint32;
                           every document's tokens followed by EOS, documents in order
    shard-00000.docs       little-endian uint64: the end offset (in tokens, EOS included)
                           of each document within its shard, ascending

The training stream is the concatenation of the shards in manifest order: exactly the
flat stream the in-memory sources build from the same corpus, so both give the same
samples. The reader reads each sample's few KB with `os.pread` from shards it opens on
first use, and its start-up cost is one small JSON file, O(number of shards).

NOTE: not `numpy.memmap`: measured on a 1 GB corpus, random samples through a memory map
made the kernel map whole folios around each fault, and a rank's RSS grew to the corpus
size (+1.9 GB for 1 GB of text, shared and reclaimable, but counted against the rank);
`pread` keeps it flat and was slightly faster (benchmarks/data.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trainer.errors import DataError

FORMAT = "moetrain-tokens/1"
MANIFEST = "manifest.json"
TOKENS_SUFFIX, DOCS_SUFFIX = ".tokens", ".docs"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenizerId:
    """What a shard's ids mean: the same kind and file hash give the same ids."""

    kind: str  # "byte" or "tokenizer.json"
    sha256: str | None  # of the tokenizer.json file; None for byte
    vocab_size: int
    eos_id: int


@dataclass(frozen=True)
class ShardInfo:
    name: str  # file stem: <name>.tokens, <name>.docs
    tokens: int
    documents: int
    sha256: str  # of the .tokens file
    docs_sha256: str  # of the .docs file


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerId
    dtype: str  # numpy dtype string of the .tokens files ("<u2" or "<u4")
    shards: list[ShardInfo]
    # What was read: {"kind": "jsonl"|"text"|"hf_datasets", ...}; for files, each
    # {"path", "size", "mtime"}, so a changed corpus is recognised.
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Manifest:
        return Manifest(
            tokenizer=TokenizerId(**d["tokenizer"]),
            dtype=d["dtype"],
            shards=[ShardInfo(**s) for s in d["shards"]],
            source=d.get("source", {}),
            format=d.get("format", "?"),
        )


def read_manifest(directory: str) -> Manifest:
    """The manifest of a prepared directory; DataError naming the fix when there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(directory) else f"has no {MANIFEST}"
        raise DataError(
            f"data.path={directory!r} {what}: data.source=tokens reads a directory written by "
            "`python -m trainer.prepare --out DIR` (an interrupted prepare has no manifest "
            "yet: run the same command again to finish it)"
        )
    try:
        with open(path) as f:
            manifest = Manifest.from_dict(json.load(f))
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a valid manifest ({err}); prepare the data again") from err
    if manifest.format != FORMAT:
        raise DataError(f"{path} has format {manifest.format!r}; this trainer reads {FORMAT!r}")
    return manifest


def check_shards(directory: str, manifest: Manifest, checksums: bool) -> None:
    """Refuse missing, truncated (sizes, always) or corrupted (checksums: reads every byte)
    shard files, naming the file."""
    width = np.dtype(manifest.dtype).itemsize
    for shard in manifest.shards:
        for suffix, size, digest in (
            (TOKENS_SUFFIX, shard.tokens * width, shard.sha256),
            (DOCS_SUFFIX, shard.documents * 8, shard.docs_sha256),
        ):
            path = os.path.join(directory, shard.name + suffix)
            if not os.path.isfile(path):
                raise DataError(f"{path} is missing; prepare the data again")
            if os.path.getsize(path) != size:
                raise DataError(
                    f"{path} has {os.path.getsize(path)} bytes but the manifest says {size} "
                    "(truncated or overwritten); prepare the data again"
                )
            if checksums and file_sha256(path) != digest:
                raise DataError(
                    f"{path} does not match its checksum in the manifest (corrupted); "
                    "prepare the data again"
                )


class ShardedTokens:
    """The concatenated token stream of a prepared directory, as a read-only sequence.

    `len()` is the number of tokens (capped at `limit`); `stream[a:b]` returns those tokens
    as a numpy array, read from the shard files (opened on first use) with `os.pread`.
    """

    def __init__(self, directory: str, manifest: Manifest, limit: int | None = None) -> None:
        self.directory = directory
        self.dtype = np.dtype(manifest.dtype)
        self.names = [s.name for s in manifest.shards]
        self.starts = np.cumsum([0] + [s.tokens for s in manifest.shards]).tolist()
        total = self.starts[-1]
        self.length = total if limit is None else min(limit, total)
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return self.length

    def _read(self, i: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of shard i."""
        if i not in self._fds:
            path = os.path.join(self.directory, self.names[i] + TOKENS_SUFFIX)
            self._fds[i] = os.open(path, os.O_RDONLY)
        width = self.dtype.itemsize
        data = os.pread(self._fds[i], (stop - start) * width, start * width)
        if len(data) != (stop - start) * width:
            raise DataError(f"{self.names[i]}{TOKENS_SUFFIX} is shorter than its manifest says")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("ShardedTokens supports contiguous slices only")
        pieces, pos = [], start
        while pos < stop:
            i = bisect_right(self.starts, pos) - 1  # the shard holding position `pos`
            end = min(stop, self.starts[i + 1])
            pieces.append(self._read(i, pos - self.starts[i], end - self.starts[i]))
            pos = end
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers open their own files: descriptors do not travel between processes.
        return {**self.__dict__, "_fds": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
