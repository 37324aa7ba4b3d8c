"""What a work unit of `python -m moetrain.prepare` writes, and the reading helpers both
kinds of unit share (`moetrain.prepare.worker`, plain text; `moetrain.prepare.instruction_unit`,
chat and prompt/completion lines): the job's types, a unit's shard and done-marker names,
the shard writer, a file's line numbers for messages, a dataset loaded once per process,
and what a marker records of invalid UTF-8. Torch-free: it runs in worker processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from moetrain.data import hf_rows, reader, shards
from moetrain.data.reader import COMMAND_LINE
from moetrain.data.utf8 import Replaced
from moetrain.fileio import fsync_path

WORK_DIR = ".work"  # plan.json and one done-NNNNN.json per finished unit

Job = dict[str, Any]
# (input bytes, documents, tokens, fresh): fresh is False for a unit found already done.
Report = Callable[[int, int, int, bool], None]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def marker_path(out: str, index: int) -> str:
    return os.path.join(out, WORK_DIR, f"done-{index:05d}.json")


def line_number(path: str, start: int, n: int) -> int:
    """The file's line number of line `n` (from 1) of a piece that starts at byte `start`."""
    return (reader.lines_before(path, start) if start else 0) + n


_HF_CACHE: dict[tuple[str, str, str | None], Any] = {}


def load_hf(path: str, split: str, field: str | None) -> Any:
    """The one-column dataset (None: a conversation's columns), loaded once per process."""
    key = (path, split, field)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = hf_rows.load_hf_dataset(path, split, field, COMMAND_LINE)
    return _HF_CACHE[key]


class ShardWriter:
    """Streams one shard to temporary files, hashing as it goes; `finish` makes it final."""

    def __init__(
        self, out: str, name: str, dtype: str, eos_id: int, block_bytes: int, masked: bool = False
    ) -> None:
        """`masked`: instruction data, with a loss mask beside the tokens (.mask, .maskcrc)."""
        suffixes = [shards.TOKENS_SUFFIX, shards.DOCS_SUFFIX, shards.CRC_SUFFIX]
        if masked:
            suffixes += [shards.MASK_SUFFIX, shards.MASK_CRC_SUFFIX]
        self.final = [os.path.join(out, name + suffix) for suffix in suffixes]
        self.tmp = [p + ".tmp" for p in self.final]
        # The tables (.crc, .maskcrc) are written at the end.
        self.files = [open(p, "wb") for p in (self.tmp[:2] + self.tmp[3:4])]
        self.digests = [hashlib.sha256() for _ in self.files]
        self.blocks = [shards.BlockCrc(block_bytes) for _ in range(1 + masked)]  # tokens, mask
        self.dtype, self.eos_id, self.masked = np.dtype(dtype), eos_id, masked
        self.tokens = self.documents = 0

    def _write(self, which: int, data: bytes) -> None:
        self.files[which].write(data)
        self.digests[which].update(data)

    def add_part(self, ids: np.ndarray) -> None:
        """Append ids of a document written in parts (moetrain/prepare/long_docs.py), which
        `add(no ids, lengths [0])` then ends: its EOS and .docs end offset."""
        data = ids.astype(self.dtype).tobytes()
        self._write(0, data)
        self.blocks[0].update(data)
        self.tokens += len(ids)

    def add(
        self,
        flat: np.ndarray,
        lengths: np.ndarray,
        mask: np.ndarray | None = None,
        eos_mask: int | np.ndarray = 0,
    ) -> int:
        """Append documents (their ids concatenated in `flat`), each followed by EOS; with a
        loss mask (aligned with `flat`; `eos_mask` for each EOS, or per document) when the
        shard has one."""
        ends = np.cumsum(lengths + 1)  # end offset of each document, its EOS included
        tokens = np.full(int(ends[-1]), self.eos_id, dtype=self.dtype)
        not_eos = np.ones(len(tokens), dtype=bool)
        not_eos[ends - 1] = False
        tokens[not_eos] = flat
        data = tokens.tobytes()
        self._write(0, data)
        self.blocks[0].update(data)
        if self.masked:
            full = np.zeros(len(tokens), dtype=np.uint8)
            full[not_eos] = mask
            full[ends - 1] = eos_mask
            self._write(2, full.tobytes())
            self.blocks[1].update(full.tobytes())
        self._write(1, (ends + self.tokens).astype("<u8").tobytes())
        self.tokens += len(tokens)
        self.documents += len(lengths)
        return len(tokens)

    def finish(self) -> dict[str, Any]:
        tables = [b.table() for b in self.blocks]
        for path, table in zip((self.tmp[2], *self.tmp[4:]), tables, strict=True):
            with open(path, "wb") as f:
                f.write(table)
                f.flush()
                os.fsync(f.fileno())
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for tmp, final in zip(self.tmp, self.final, strict=True):
            os.replace(tmp, final)
        fsync_path(os.path.dirname(self.final[0]))
        done = {
            "tokens": self.tokens,
            "documents": self.documents,
            "sha256": self.digests[0].hexdigest(),
            "docs_sha256": self.digests[1].hexdigest(),
            "crc_sha256": hashlib.sha256(tables[0]).hexdigest(),
        }
        if self.masked:
            done["mask_sha256"] = self.digests[2].hexdigest()
            done["mask_crc_sha256"] = hashlib.sha256(tables[1]).hexdigest()
        return done

    def abort(self) -> None:
        for f in self.files:
            f.close()
        for tmp in self.tmp:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


def replaced_fields(replaced: Replaced) -> dict[str, Any]:
    """What a done marker records of the unit's invalid UTF-8 (none: nothing), so that a
    resumed prepare reports reused units' too."""
    if not replaced.count:
        return {}
    return {"replaced_documents": replaced.count, "replaced_first": replaced.first}
