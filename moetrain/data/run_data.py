"""Everything a run reads: its training samples (one corpus, or a blend of prepared corpora
by `[[data.mix]]`) and its held-out samples (`[eval]`: a prepared corpus, a blend of them,
or a fraction of the training corpus' documents)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from moetrain.config import DataSection, EvalSection, MixSource
from moetrain.data.conversations import PackedConversations
from moetrain.data.corpus import check_prepared, open_corpus
from moetrain.data.mixture import MixtureDataset, interleave
from moetrain.data.packing import CorpusSummary, PackedDataset
from moetrain.data.prepared import Corpora, PreparedCorpus
from moetrain.data.tokenizers import Tokenizer
from moetrain.errors import DataError


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
    corpus: PreparedCorpus, cfg: DataSection, tokenizer: Tokenizer, vocab: int | None, **kw
) -> PackedConversations:
    digest = corpus.fingerprint()
    digest.update(f"whole documents in {cfg.seq_len + 1} {kw}".encode())
    return PackedConversations(
        corpus,
        cfg.seq_len,
        tokenizer.eos_id,
        bool(cfg.reset_positions),
        vocab,
        fingerprint=digest.hexdigest(),
        **kw,
    )


def _prepared(
    corpus: PreparedCorpus, cfg: DataSection, tokenizer: Tokenizer, vocab: int | None
) -> PackedDataset | PackedConversations:
    """A prepared directory's samples: whole documents when it carries a loss mask."""
    if corpus.loss_mask:
        return _conversations(corpus, cfg, tokenizer, vocab)
    stream = corpus.tokens(vocab_size=vocab)
    summary = CorpusSummary(
        corpus.describe(),
        corpus.num_documents,
        len(stream),
        len(stream),
        truncated=False,
        fingerprint=corpus.fingerprint().hexdigest(),
    )
    return PackedDataset(stream, cfg.seq_len, tokenizer.eos_id, summary, cfg.reset_positions)


def _blend(
    tables: list[MixSource],
    corpora: Corpora,
    cfg: DataSection,
    tokenizer: Tokenizer,
    vocab: int | None,
) -> list[Source]:
    total = sum(t.weight for t in tables)
    return [
        Source(source_name(t), t.weight / total, _prepared(corpora[t.path], cfg, tokenizer, vocab))
        for t in tables
    ]


def eval_shares(tables: list[MixSource], samples: int) -> list[int]:
    """eval.samples shared out over [[eval.mix]] by weight, as the training blend would
    share them (each within one sample of its weight's share)."""
    if not tables:
        return []
    total = sum(t.weight for t in tables)
    counts = [0] * len(tables)
    interleave([t.weight / total for t in tables], counts, 0, samples)
    return counts


def _blend_summary(sources: list[Source]) -> CorpusSummary:
    digest = hashlib.sha256()
    for s in sources:  # the data identity: each corpus' content, name and weight
        digest.update(f"{s.name}:{s.weight!r}:{s.dataset.summary.fingerprint}".encode())
    tokens = sum(s.dataset.summary.tokens for s in sources)
    # Each weight as repr, the digits the identity hashes: a resume refused because the
    # weights changed prints the checkpoint's blend and this one, and they must differ.
    weights = ", ".join(f"{s.name} {s.weight!r}" for s in sources)
    return CorpusSummary(
        f"blend of {len(sources)} prepared corpora (weights: {weights})",
        sum(s.dataset.summary.documents for s in sources),
        tokens,
        tokens,
        truncated=False,
        fingerprint=digest.hexdigest(),
    )


def build_data(
    cfg: DataSection,
    eval_cfg: EvalSection | None,
    tokenizer: Tokenizer,
    vocab: int | None = None,
    corpora: Corpora | None = None,
) -> RunData:
    """The run's training dataset and held-out datasets (see the module doc). `corpora`:
    the config's prepared directories, as the preflight opened them (else opened here)."""
    eval_cfg = eval_cfg or EvalSection()
    corpora = corpora or Corpora(cfg, eval_cfg)
    n = eval_cfg.samples
    held_out: list[HeldOut] = []
    if cfg.mix:
        sources = _blend(cfg.mix, corpora, cfg, tokenizer, vocab)
        datasets = [s.dataset for s in sources]
        train = MixtureDataset(datasets, [s.name for s in sources], _blend_summary(sources))
    elif cfg.source == "tokens" and corpora[cfg.path].loss_mask:
        sources, fraction, corpus = [], eval_cfg.fraction, corpora[cfg.path]
        train = _conversations(
            corpus, cfg, tokenizer, vocab, holdout=fraction, max_tokens=cfg.max_tokens
        )
        if fraction is not None:  # (with data.max_tokens: every held-out document)
            held = _conversations(corpus, cfg, tokenizer, vocab, holdout=fraction, evaluation=True)
            held_out = [HeldOut("held_out", held, n)]
    else:
        sources = []
        stream, summary, held = open_corpus(cfg, tokenizer, vocab, eval_cfg.fraction, corpora)
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
        dataset = _prepared(corpora[eval_cfg.path], cfg, tokenizer, vocab)
        held_out = [HeldOut("eval", dataset, n)]
    elif eval_cfg.mix:
        blend = _blend(eval_cfg.mix, corpora, cfg, tokenizer, vocab)
        counts = eval_shares(eval_cfg.mix, n)
        held_out = [HeldOut(s.name, s.dataset, c) for s, c in zip(blend, counts, strict=True)]
    for h in held_out:
        if len(h.dataset) < h.samples:
            raise DataError(
                f"the held-out data {h.name!r} has {len(h.dataset):,} samples of data.seq_len="
                f"{cfg.seq_len}, fewer than the {h.samples} eval.samples asks of it; "
                "lower eval.samples" + (" or raise eval.fraction" if eval_cfg.fraction else "")
            )
    return RunData(train, sources, held_out)


def check_held_out(
    cfg: DataSection, eval_cfg: EvalSection, tokenizer: Tokenizer, corpora: Corpora
) -> None:
    """Refuse held-out data this run cannot read, before any process group exists."""
    if eval_cfg.path:
        check_prepared(corpora[eval_cfg.path], cfg, tokenizer)
    for table in eval_cfg.mix:
        check_prepared(corpora[table.path], cfg, tokenizer)
    # A source given no sample would have no tokens to take its loss over (0 / 0).
    shares = eval_shares(eval_cfg.mix, eval_cfg.samples)
    for i, (table, share) in enumerate(zip(eval_cfg.mix, shares, strict=True), start=1):
        if share == 0:
            raise DataError(
                f"eval.mix[{i}] ({source_name(table)}) gets none of the eval.samples="
                f"{eval_cfg.samples} by its weight ({table.weight:g} of "
                f"{sum(t.weight for t in eval_cfg.mix):g}): raise its weight or eval.samples"
            )
