"""Everything a run reads: its training samples (one corpus, or a blend of prepared corpora
by `[[data.mix]]`) and its held-out samples (`[eval]`: a prepared corpus, a blend of them,
or a fraction of the training corpus' documents)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from trainer.config import DataSection, EvalSection, MixSource
from trainer.data.conversations import PackedConversations
from trainer.data.corpus import check_prepared, open_corpus, prepared_fingerprint
from trainer.data.mixture import MixtureDataset, interleave
from trainer.data.packing import CorpusSummary, PackedDataset
from trainer.data.shards import ShardedTokens, read_manifest
from trainer.data.tokenizers import Tokenizer
from trainer.errors import DataError


def source_name(table: MixSource) -> str:
    return table.name or os.path.basename(os.path.normpath(table.path))


@dataclass(frozen=True)
class Source:
    """One corpus of a blend."""

    name: str
    weight: float  # normalised
    dataset: PackedDataset

    def describe(self, run_samples: int, seq_len: int) -> str:
        """The console line: its weight, size, share of the run and epochs the run sees."""
        samples = len(self.dataset)
        return (
            f"  {self.name}: weight {self.weight:.3f}, {self.dataset.summary.tokens:,} tokens "
            f"({samples:,} samples), {self.weight:.1%} of the run's "
            f"{run_samples * seq_len:,} tokens = {self.weight * run_samples / samples:.2f} epochs"
        )


@dataclass(frozen=True)
class HeldOut:
    """Held-out samples of one source: the first `samples` of `dataset`, every round."""

    name: str
    dataset: PackedDataset
    samples: int


@dataclass(frozen=True)
class RunData:
    train: PackedDataset | PackedConversations | MixtureDataset  # `.summary`: what it holds
    sources: list[Source]  # a blend's corpora (empty for one corpus)
    held_out: list[HeldOut]  # [eval] data, one entry per source (empty without)


def _conversations(
    path: str, cfg: DataSection, tokenizer: Tokenizer, vocab: int | None, **kw
) -> PackedConversations:
    manifest = read_manifest(path)
    digest = prepared_fingerprint(manifest)
    digest.update(f"whole documents in {cfg.seq_len + 1} {kw}".encode())
    return PackedConversations(
        path, manifest, cfg.seq_len, tokenizer.eos_id, bool(cfg.reset_positions), vocab,
        fingerprint=digest.hexdigest(), **kw,
    )  # fmt: skip


def _prepared(
    path: str, cfg: DataSection, tokenizer: Tokenizer, vocab: int | None
) -> PackedDataset | PackedConversations:
    """A prepared directory's samples: whole documents when it carries a loss mask."""
    manifest = read_manifest(path)
    if manifest.loss_mask:
        return _conversations(path, cfg, tokenizer, vocab)
    stream = ShardedTokens(path, manifest, None, vocab)
    summary = CorpusSummary(
        f"tokens ({path}, {len(manifest.shards)} shards)",
        manifest.num_documents,
        len(stream),
        len(stream),
        truncated=False,
        fingerprint=prepared_fingerprint(manifest).hexdigest(),
    )
    return PackedDataset(stream, cfg.seq_len, tokenizer.eos_id, summary, cfg.reset_positions)


def _blend(
    tables: list[MixSource], cfg: DataSection, tokenizer: Tokenizer, vocab: int | None
) -> list[Source]:
    total = sum(t.weight for t in tables)
    return [
        Source(source_name(t), t.weight / total, _prepared(t.path, cfg, tokenizer, vocab))
        for t in tables
    ]


def _blend_summary(sources: list[Source]) -> CorpusSummary:
    digest = hashlib.sha256()
    for s in sources:  # the data identity: each corpus' content, name and weight
        digest.update(f"{s.name}:{s.weight!r}:{s.dataset.summary.fingerprint}".encode())
    tokens = sum(s.dataset.summary.tokens for s in sources)
    return CorpusSummary(
        f"blend of {len(sources)} prepared corpora ({', '.join(s.name for s in sources)})",
        sum(s.dataset.summary.documents for s in sources),
        tokens,
        tokens,
        truncated=False,
        fingerprint=digest.hexdigest(),
    )


def build_data(
    cfg: DataSection, eval_cfg: EvalSection | None, tokenizer: Tokenizer, vocab: int | None = None
) -> RunData:
    """The run's training dataset and held-out datasets (see the module doc)."""
    eval_cfg = eval_cfg or EvalSection()
    n = eval_cfg.samples
    held_out: list[HeldOut] = []
    if cfg.mix:
        sources = _blend(cfg.mix, cfg, tokenizer, vocab)
        datasets = [s.dataset for s in sources]
        train = MixtureDataset(datasets, [s.name for s in sources], _blend_summary(sources))
    elif cfg.source == "tokens" and read_manifest(cfg.path).loss_mask:
        sources, fraction = [], eval_cfg.fraction
        train = _conversations(
            cfg.path, cfg, tokenizer, vocab, holdout=fraction, max_tokens=cfg.max_tokens
        )
        if fraction is not None:  # (with data.max_tokens: every held-out document)
            held = _conversations(
                cfg.path, cfg, tokenizer, vocab, holdout=fraction, evaluation=True
            )
            held_out = [HeldOut("held_out", held, n)]
    else:
        sources = []
        stream, summary, held = open_corpus(cfg, tokenizer, vocab, eval_cfg.fraction)
        train = PackedDataset(stream, cfg.seq_len, tokenizer.eos_id, summary, cfg.reset_positions)
        if held is not None:
            if len(held) <= cfg.seq_len:
                raise DataError(
                    f"eval.fraction={eval_cfg.fraction} held out {len(held)} tokens of the "
                    f"corpus, not one sample of data.seq_len={cfg.seq_len}: raise eval.fraction"
                )
            dataset = PackedDataset(held, cfg.seq_len, tokenizer.eos_id, None, cfg.reset_positions)
            held_out = [HeldOut("held_out", dataset, n)]
    if eval_cfg.path:
        dataset = _prepared(eval_cfg.path, cfg, tokenizer, vocab)
        held_out = [HeldOut("eval", dataset, n)]
    elif eval_cfg.mix:
        blend = _blend(eval_cfg.mix, cfg, tokenizer, vocab)
        # eval.samples shared out by weight, as the training blend would (within one each).
        counts = [0] * len(blend)
        interleave([s.weight for s in blend], counts, 0, n)
        held_out = [HeldOut(s.name, s.dataset, c) for s, c in zip(blend, counts, strict=True)]
    for h in held_out:
        if len(h.dataset) < h.samples:
            raise DataError(
                f"the held-out data {h.name!r} has {len(h.dataset):,} samples of data.seq_len="
                f"{cfg.seq_len}, fewer than the {h.samples} eval.samples asks of it; "
                "lower eval.samples" + (" or raise eval.fraction" if eval_cfg.fraction else "")
            )
    return RunData(train, sources, held_out)


def check_held_out(cfg: DataSection, eval_cfg: EvalSection, tokenizer: Tokenizer) -> None:
    """Refuse held-out data this run cannot read, before any process group exists."""
    for path in [eval_cfg.path] if eval_cfg.path else [t.path for t in eval_cfg.mix]:
        check_prepared(path, cfg, tokenizer)
