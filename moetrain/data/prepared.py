"""A prepared corpus (a directory written by `python -m moetrain.prepare`), opened once.

Invariant: a run reads each prepared directory's manifest once. `Corpora` opens every
directory a run's config names (`data.path`, `[[data.mix]]`, `eval.path`, `[[eval.mix]]`)
before any check; the preflight checks, the document flags, the training stream (plain,
with a held-out share, or whole conversations), blends and evaluation all take the
`PreparedCorpus` it holds, and ask it for what they need: its fingerprint, its token and
mask streams, its document table, its held-out view. Nothing else calls `read_manifest`.

The data path then runs one way: config -> `Corpora` (manifests) -> checks -> datasets
(`moetrain.data.run_data`) -> loader.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from moetrain.config import DataSection, EvalSection, MixSource
from moetrain.data.shards import DOCS_SUFFIX, Manifest, ShardedTokens, read_manifest


@dataclass(frozen=True)
class PreparedCorpus:
    """One prepared directory and its manifest. `key`: the config key that named it
    (data.path, data.mix[2].path, eval.path, ...), which every message about it names."""

    path: str
    key: str
    manifest: Manifest

    @classmethod
    def open(cls, path: str, key: str = "data.path") -> PreparedCorpus:
        """Read the manifest (the one read of it); DataError naming `key` and the fix when
        the directory is not a complete prepared corpus."""
        return cls(path, key, read_manifest(path, key))

    @property
    def loss_mask(self) -> bool:
        return self.manifest.loss_mask

    @property
    def num_documents(self) -> int:
        return self.manifest.num_documents

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def describe(self, what: str = "tokens") -> str:
        """The console's name for it: `tokens (PATH, N shards)`."""
        return f"{what} ({self.path}, {len(self.manifest.shards)} shards)"

    def fingerprint(self) -> hashlib._Hash:
        """A fresh digest of its content (tokenizer and every shard's checksum), for the
        caller to extend with how it reads the corpus."""
        digest = hashlib.sha256(repr(self.manifest.tokenizer).encode())
        for shard in self.manifest.shards:
            digest.update(shard.sha256.encode())
        return digest

    def tokens(self, limit: int | None = None, vocab_size: int | None = None) -> ShardedTokens:
        """The concatenated token stream (ids checked against `vocab_size` when given)."""
        return ShardedTokens(self.path, self.manifest, limit, vocab_size)

    def masks(self) -> ShardedTokens:
        """The loss mask stream (uint8 per token), for a corpus with `loss_mask`."""
        return ShardedTokens(self.path, self.manifest, None, None, mask=True)

    def shard_documents(self) -> list[int]:
        """Documents per shard, in order."""
        return [s.documents for s in self.manifest.shards]

    def shard_document_ends(self, i: int) -> np.ndarray:
        """Shard i's document end offsets within the shard (EOS included): int64 [docs]."""
        path = f"{self.path}/{self.manifest.shards[i].name}{DOCS_SUFFIX}"
        return np.fromfile(path, dtype="<u8").astype(np.int64)

    def document_ends(self) -> np.ndarray:
        """Every document's end offset in the concatenated stream, EOS included: int64."""
        ends, base = [], 0
        for i, shard in enumerate(self.manifest.shards):
            ends.append(self.shard_document_ends(i) + base)
            base += shard.tokens
        return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)


def _mix_paths(section: str, tables: list[MixSource]) -> list[tuple[str, str]]:
    """(key, path) of each table of [[data.mix]] or [[eval.mix]]: `data.mix[2].path`."""
    return [(f"{section}.mix[{i}].path", t.path) for i, t in enumerate(tables, start=1)]


def prepared_paths(data: DataSection, eval_cfg: EvalSection | None) -> list[tuple[str, str]]:
    """(key, path) of every prepared directory the config names, in config order."""
    found = []
    if data.source == "tokens":
        found += _mix_paths("data", data.mix) or [("data.path", data.path)]
    if eval_cfg is not None:
        found += [("eval.path", eval_cfg.path)] if eval_cfg.path else []
        found += _mix_paths("eval", eval_cfg.mix)
    return found


class Corpora:
    """Every prepared directory of one run's config, each opened once, by path (a
    directory named twice, e.g. as data and as eval, is one corpus, named by its first
    key)."""

    def __init__(self, data: DataSection, eval_cfg: EvalSection | None = None) -> None:
        self.by_path: dict[str, PreparedCorpus] = {}  # by real path: `x` and `x/` are one
        for key, path in prepared_paths(data, eval_cfg):
            real = os.path.realpath(path)
            if real not in self.by_path:
                self.by_path[real] = PreparedCorpus.open(path, key)

    def __getitem__(self, path: str) -> PreparedCorpus:
        return self.by_path[os.path.realpath(path)]
