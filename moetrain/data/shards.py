"""Prepared token shards: the on-disk format, and a reader that touches only what it reads.

`python -m moetrain.prepare` writes a directory:

    manifest.json          written last (atomically): its presence means complete
    shard-00000.tokens     token ids, little-endian uint16 (vocab <= 65536) or uint32;
                           every document's tokens followed by EOS, documents in order
    shard-00000.docs       little-endian uint64: the end offset (in tokens, EOS included)
                           of each document within its shard, ascending
    shard-00000.crc        little-endian uint32: the CRC-32 of each `block_bytes` block of
                           the .tokens file (the last block may be shorter)
    shard-00000.mask       with `loss_mask` (instruction data): uint8 per token, 1 where the
                           token is a target of the loss (assistant turns, completions)
    shard-00000.maskcrc    its block CRC-32s, as .crc for .tokens

The training stream is the concatenation of the shards in manifest order: exactly the
flat stream the in-memory sources build from the same corpus, so both give the same
samples. The reader reads each sample's few KB with `os.pread` from shards it opens on
first use, and its start-up cost is one small JSON file, O(number of shards).

Every byte is verified before it is trained on: the reader checks each block's CRC-32 the
first time this process reads from it, and every token id against the model's vocabulary,
so a flipped byte is refused (naming the shard, the offset and the command that re-prepares
it) before its sample reaches the model. Start-up checks sizes (`data.verify=size`) or
also every file's sha256 (`checksum`).

NOTE: 64 KiB blocks, not 1 MiB: a rank reads samples at random, and the first read of a
block reads and checks all of it. With 1 MiB blocks a 4K-token sample (8-16 KB) made the
rank read ~64x the bytes it needed; with 64 KiB about 4x, for a table of 4 bytes per 64 KiB
(64 KB per GB of tokens). Figures: benchmarks/data.py.

NOTE: not `numpy.memmap`: measured on a 1 GB corpus, random samples through a memory map
made the kernel map whole folios around each fault, and a rank's RSS grew to the corpus
size (+1.9 GB for 1 GB of text, shared and reclaimable, but counted against the rank);
`pread` keeps it flat and was slightly faster (benchmarks/data.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import zlib
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moetrain.errors import DataError

FORMAT = "moetrain-tokens/2"
MANIFEST = "manifest.json"
TOKENS_SUFFIX, DOCS_SUFFIX, CRC_SUFFIX = ".tokens", ".docs", ".crc"
MASK_SUFFIX, MASK_CRC_SUFFIX = ".mask", ".maskcrc"
BLOCK_BYTES = 64 << 10


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
    crc_sha256: str  # of the .crc file
    mask_sha256: str | None = None  # of the .mask file (loss_mask corpora)
    mask_crc_sha256: str | None = None  # of the .maskcrc file


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerId
    dtype: str  # numpy dtype string of the .tokens files ("<u2" or "<u4")
    shards: list[ShardInfo]
    # What was read: {"kind": "jsonl"|"text"|"hf_datasets", ...}; for files, each
    # {"path", "size", "mtime"}, so a changed corpus is recognised.
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    block_bytes: int = BLOCK_BYTES  # the .crc files' block size
    loss_mask: bool = False  # shards carry .mask files (`prepare --format chat|prompt_completion`)
    # `prepare --format preference`: documents 2k and 2k + 1 are pair k's chosen and rejected
    # sides (a shard holds whole pairs)
    preference: bool = False
    # `python -m moetrain.prepare ...` that writes these bytes, less `--out` (a re-run resumes)
    command: str = ""

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
            block_bytes=d.get("block_bytes", BLOCK_BYTES),
            loss_mask=d.get("loss_mask", False),
            preference=d.get("preference", False),
            command=d.get("command", ""),
        )


def read_manifest(directory: str, key: str = "data.path") -> Manifest:
    """The manifest of a prepared directory; DataError naming the fix when there is none.
    `key`: the config key that named the directory (e.g. eval.mix[2].path), for the message."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(directory) else f"has no {MANIFEST}"
        raise DataError(
            f"{key}={directory!r} {what}: it must name a directory written by "
            "`python -m moetrain.prepare --out DIR` (an interrupted prepare has no manifest "
            "yet: run the same command again to finish it)"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
        found = raw.get("format", "?") if isinstance(raw, dict) else "?"
        if found != FORMAT:
            raise DataError(
                f"{key}: {path} has format {found!r}; this trainer reads {FORMAT!r} (block "
                "checksums were added in /2): run the `python -m moetrain.prepare` command that "
                "wrote it again with --overwrite"
            )
        manifest = Manifest.from_dict(raw)
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"{key}: {path} is not a valid manifest ({err}); prepare the data again"
        ) from err
    return manifest


def crc_entries(nbytes: int, block_bytes: int) -> int:
    """Blocks (CRC-32 entries) of a file of `nbytes` bytes."""
    return -(-nbytes // block_bytes)


class BlockCrc:
    """CRC-32 of each `block_bytes` block of a byte stream written in pieces of any size."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.crcs: list[int] = []
        self._crc = self._filled = 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.block_bytes - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self.crcs.append(self._crc)
                self._crc = self._filled = 0

    def table(self) -> bytes:
        """The .crc file's bytes: every full block, then the last partial one."""
        tail = [self._crc] if self._filled else []
        return np.asarray(self.crcs + tail, dtype="<u4").tobytes()


def _expected_files(manifest: Manifest, shard: ShardInfo) -> list[tuple[str, int, str]]:
    tokens = shard.tokens * np.dtype(manifest.dtype).itemsize
    files = [
        (TOKENS_SUFFIX, tokens, shard.sha256),
        (DOCS_SUFFIX, shard.documents * 8, shard.docs_sha256),
        (CRC_SUFFIX, 4 * crc_entries(tokens, manifest.block_bytes), shard.crc_sha256),
    ]
    if manifest.loss_mask:
        masks = 4 * crc_entries(shard.tokens, manifest.block_bytes)
        files += [
            (MASK_SUFFIX, shard.tokens, shard.mask_sha256),
            (MASK_CRC_SUFFIX, masks, shard.mask_crc_sha256),
        ]
    return files


def check_shards(directory: str, manifest: Manifest, checksums: bool) -> None:
    """Refuse missing, truncated (sizes, always) or corrupted (checksums: reads every byte)
    shard files, naming the file."""
    for shard in manifest.shards:
        for suffix, size, digest in _expected_files(manifest, shard):
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
    Each block's CRC-32 is checked the first time this process reads from it, and every id
    against `vocab_size` (the model's) when given: a damaged shard is refused by name.
    """

    def __init__(
        self,
        directory: str,
        manifest: Manifest,
        limit: int | None = None,
        vocab_size: int | None = None,
        mask: bool = False,
    ) -> None:
        """`mask`: read the shards' loss masks (uint8 per token) instead of their tokens."""
        self.directory = directory
        self.suffix, self.crc_suffix = (
            (MASK_SUFFIX, MASK_CRC_SUFFIX) if mask else (TOKENS_SUFFIX, CRC_SUFFIX)
        )
        self.dtype = np.dtype("<u1") if mask else np.dtype(manifest.dtype)
        self.names = [s.name for s in manifest.shards]
        self.starts = np.cumsum([0] + [s.tokens for s in manifest.shards]).tolist()
        total = self.starts[-1]
        self.length = total if limit is None else min(limit, total)
        self.block = manifest.block_bytes
        self.vocab_size = vocab_size
        self.command = manifest.command
        self._fds: dict[int, int] = {}
        self._crcs: dict[int, np.ndarray] = {}  # shard -> its block CRC-32s, read on first use
        self._verified: dict[int, bytearray] = {}  # shard -> 1 for each block already checked
        self._docs: dict[int, np.ndarray] = {}  # shard -> its document ends, read on first use

    def __len__(self) -> int:
        return self.length

    def _path(self, i: int, suffix: str) -> str:
        return os.path.join(self.directory, self.names[i] + suffix)

    def _open(self, i: int) -> int:
        if i not in self._fds:
            self._fds[i] = os.open(self._path(i, self.suffix), os.O_RDONLY)
            crcs = np.fromfile(self._path(i, self.crc_suffix), dtype="<u4")
            size = (self.starts[i + 1] - self.starts[i]) * self.dtype.itemsize
            if len(crcs) != crc_entries(size, self.block):
                raise self._damaged(i, f"its {self.crc_suffix} table has {len(crcs)} entries")
            self._crcs[i], self._verified[i] = crcs, bytearray(len(crcs))
        return self._fds[i]

    def _damaged(self, i: int, what: str) -> DataError:
        again = (
            f"run again the command that prepared it, which redoes only damaged shards: "
            f"{self.command} --out {shlex.quote(self.directory)}"
            if self.command
            else "run again the `python -m moetrain.prepare` command that prepared it"
        )
        return DataError(
            f"{self._path(i, self.suffix)} is damaged: {what}; it was not trained on. "
            f"`python -m moetrain.prepare --verify --out {self.directory}` lists every damaged "
            f"file; to repair, {again}"
        )

    def read(self, i: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of shard i, every byte of them verified."""
        fd, width, block = self._open(i), self.dtype.itemsize, self.block
        lo, hi = start * width, stop * width
        first, last = lo // block, (hi - 1) // block
        verified = self._verified[i]
        if all(verified[first : last + 1]):
            data = os.pread(fd, hi - lo, lo)
        else:  # read whole blocks, check the new ones, keep the slice asked for
            size = (self.starts[i + 1] - self.starts[i]) * width
            span_lo, span_hi = first * block, min((last + 1) * block, size)
            span = os.pread(fd, span_hi - span_lo, span_lo)
            if len(span) != span_hi - span_lo:
                raise self._damaged(i, "it is shorter than its manifest says")
            for b in range(first, last + 1):
                if not verified[b]:
                    piece = span[(b - first) * block : (b - first + 1) * block]
                    if zlib.crc32(piece) != int(self._crcs[i][b]):
                        where = f"bytes {b * block}-{b * block + len(piece) - 1}"
                        raise self._damaged(i, f"{where} do not match their CRC-32")
                    verified[b] = 1
            data = span[lo - span_lo : hi - span_lo]
        if len(data) != hi - lo:
            raise self._damaged(i, "it is shorter than its manifest says")
        tokens = np.frombuffer(data, dtype=self.dtype)
        if self.vocab_size is not None and len(tokens) and int(tokens.max()) >= self.vocab_size:
            at = int(np.argmax(tokens >= self.vocab_size))
            raise DataError(
                f"{self._path(i, self.suffix)}: its token {start + at} (byte "
                f"{(start + at) * width}) is id {int(tokens[at])}, not below model.vocab_size="
                f"{self.vocab_size}; it was not trained on. The bytes match their checksums, so "
                "they were written with ids this model cannot take: prepare the corpus again "
                "with the model's tokenizer"
            )
        return tokens

    def _ends(self, i: int) -> np.ndarray:
        """Shard i's document end offsets within the shard (EOS included), read on first
        use: int64 [docs]."""
        if i not in self._docs:
            self._docs[i] = np.fromfile(self._path(i, DOCS_SUFFIX), dtype="<u8").astype(np.int64)
        return self._docs[i]

    def ends_within(self, start: int, stop: int) -> np.ndarray:
        """The end offsets e of the documents ending in (start, stop] of the stream (e is one
        past the document's EOS), from the shards' document index: int64, ascending."""
        found = []
        stop = min(stop, self.length)
        i = bisect_right(self.starts, start) - 1
        while i < len(self.names) and self.starts[i] < stop:
            ends = self._ends(i) + self.starts[i]
            found.append(ends[(ends > start) & (ends <= stop)])
            i += 1
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("ShardedTokens supports contiguous slices only")
        pieces, pos = [], start
        while pos < stop:
            i = bisect_right(self.starts, pos) - 1  # the shard holding position `pos`
            end = min(stop, self.starts[i + 1])
            pieces.append(self.read(i, pos - self.starts[i], end - self.starts[i]))
            pos = end
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers open their own files: descriptors do not travel between processes.
        return {**self.__dict__, "_fds": {}, "_crcs": {}, "_verified": {}, "_docs": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
