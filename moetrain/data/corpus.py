"""Which token stream a run trains on, checked before any process group exists.

Two kinds of source give the same stream for the same corpus:

- `tokens`: a directory prepared once by `python -m moetrain.prepare`, read by memory map
  (`shards.ShardedTokens`): a rank's RAM does not grow with the corpus, and start-up reads
  one manifest;
- in memory, for small corpora (`stdlib`, `text`, `jsonl`, `hf_datasets`): every rank
  reads and tokenizes the whole corpus (about 4 bytes of RAM per byte of text), so corpora
  above `data.max_in_memory_mb` are refused with the `prepare` command to run instead.
"""

from __future__ import annotations

import hashlib
import os

from moetrain.config import DataSection
from moetrain.data.conversations import check_some_fit, document_lengths
from moetrain.data.holdout import HOLDOUT_HASH, DocumentView
from moetrain.data.packing import CorpusSummary, TokenStream, pack_split
from moetrain.data.prepared import Corpora, PreparedCorpus
from moetrain.data.shards import TokenizerId, check_shards, file_sha256
from moetrain.data.sources import iter_documents, source_files
from moetrain.data.tokenizers import HFTokenizer, Tokenizer
from moetrain.errors import DataError


def tokenizer_id(tokenizer: Tokenizer) -> TokenizerId:
    """The identity a prepared directory records for the tokenizer that made it."""
    if isinstance(tokenizer, HFTokenizer):
        return TokenizerId(
            "tokenizer.json",
            file_sha256(str(tokenizer.path)),
            tokenizer.vocab_size,
            tokenizer.eos_id,
        )
    return TokenizerId("byte", None, tokenizer.vocab_size, tokenizer.eos_id)


def _prepare_hint(cfg: DataSection) -> str:
    tok = cfg.tokenizer
    return (
        f"python -m moetrain.prepare --source {cfg.source} --path '{cfg.path}' "
        f"--tokenizer {tok} --out PREPARED_DIR, then train with data.source=tokens "
        "data.path=PREPARED_DIR"
    )


def check_prepared(corpus: PreparedCorpus, cfg: DataSection, tokenizer: Tokenizer) -> None:
    """Refuse a prepared directory this run cannot read: another tokenizer than the run's,
    missing or truncated shards, no documents (a missing or invalid manifest was refused
    when it was opened). Messages name the config key that named it (data.path,
    data.mix[i].path, eval.path, eval.mix[i].path)."""
    path, key, manifest = corpus.path, corpus.key, corpus.manifest
    ours, theirs = tokenizer_id(tokenizer), manifest.tokenizer
    if ours != theirs:
        raise DataError(
            f"{key}: {path} was prepared with tokenizer {theirs.kind} (vocab "
            f"{theirs.vocab_size}, EOS {theirs.eos_id}, sha256 {theirs.sha256}) but this run uses "
            f"data.tokenizer={cfg.tokenizer!r} ({ours.kind}, vocab {ours.vocab_size}, EOS "
            f"{ours.eos_id}, sha256 {ours.sha256}); use the same tokenizer or prepare again"
        )
    try:
        check_shards(path, manifest, checksums=cfg.verify == "checksum")
    except DataError as err:  # it names the file; the key says which table it belongs to
        raise DataError(f"{key}: {err}") from None
    if manifest.num_documents == 0:
        raise DataError(f"{key}: {path} holds no documents; prepare a non-empty corpus")
    if manifest.num_tokens <= cfg.seq_len:
        raise DataError(
            f"{key}: {path} holds {manifest.num_tokens} tokens: not one sample of "
            f"data.seq_len={cfg.seq_len}; prepare more text into it or lower data.seq_len"
        )
    if manifest.loss_mask:  # whole documents only: one that fits is needed, not many tokens
        pairs = manifest.preference
        check_some_fit(document_lengths(corpus), cfg.seq_len, f"{key}: {path}", pairs)


def check_corpus(cfg: DataSection, tokenizer: Tokenizer, corpora: Corpora | None = None) -> None:
    """Refuse a source this run cannot use, cheaply (no tokenizing), naming the fix.
    `corpora`: the run's prepared directories, opened (else opened here)."""
    if cfg.source == "tokens":
        corpora = corpora or Corpora(cfg)
        for path in [t.path for t in cfg.mix] or [cfg.path]:
            check_prepared(corpora[path], cfg, tokenizer)
        return
    files = source_files(cfg)  # None: not a file source (hf_datasets)
    if files is not None and cfg.max_tokens is None:
        total = sum(os.path.getsize(f) for f in files)
        if total > cfg.max_in_memory_mb << 20:
            raise DataError(
                f"data.path={cfg.path!r} is {total / 2**20:,.0f} MB of text, above "
                f"data.max_in_memory_mb={cfg.max_in_memory_mb}: every rank would tokenize it "
                f"into RAM. Prepare it once: {_prepare_hint(cfg)}"
            )
    if not any(doc for doc in iter_documents(cfg)):
        raise DataError(f"data.source={cfg.source!r} data.path={cfg.path!r}: the corpus is empty")


def check_objective(objective: str, corpora: Corpora) -> None:
    """`train.objective=dpo` reads preference corpora alone, and an SFT run none: it would
    train the rejected answers as well as the chosen ones."""
    for corpus in corpora.by_path.values():
        if corpus.manifest.preference == (objective == "dpo"):
            continue
        if objective == "dpo":
            made = "--format " + str(corpus.manifest.source.get("format", "text"))
            raise DataError(
                f"{corpus.key}: {corpus.path} holds no preference pairs (prepared with "
                f"{made}), and train.objective=dpo trains on pairs; prepare it with "
                "`python -m moetrain.prepare --format preference`"
            )
        raise DataError(
            f"{corpus.key}: {corpus.path} holds preference pairs (--format preference), and "
            f"train.objective={objective} would train the rejected answers as well as the "
            "chosen ones; set train.objective=dpo, or prepare the chosen conversations with "
            "--format chat"
        )


def resolve_document_flags(cfg: DataSection, corpora: Corpora) -> None:
    """`data.document_mask` and `data.reset_positions` left at none: on for prepared shards
    with a loss mask (each conversation its own document), off for every other source."""
    paths = ([t.path for t in cfg.mix] or [cfg.path]) if cfg.source == "tokens" else []
    masked = any(corpora[p].loss_mask for p in paths)
    if cfg.document_mask is None:
        cfg.document_mask = masked
    if cfg.reset_positions is None:
        cfg.reset_positions = masked


def open_corpus(
    cfg: DataSection,
    tokenizer: Tokenizer,
    vocab_size: int | None = None,
    holdout: float | None = None,
    corpora: Corpora | None = None,
) -> tuple[TokenStream, CorpusSummary, TokenStream | None]:
    """The flat token stream of the configured source (cut at data.max_tokens), what it
    holds (for the console line), and, with `holdout` (eval.fraction), the stream of the
    documents held out of it (`moetrain.data.holdout`). Prepared shards are verified as they
    are read, their ids against `vocab_size` (the model's) when given."""
    held: TokenStream | None = None
    if cfg.source == "tokens":
        corpus = (corpora or Corpora(cfg))[cfg.path]
        documents, total = corpus.num_documents, corpus.num_tokens
        if holdout is None:
            stream = corpus.tokens(cfg.max_tokens, vocab_size)
        else:
            shards = corpus.tokens(vocab_size=vocab_size)
            stream = DocumentView(corpus, shards, holdout, False, cfg.max_tokens)
            held = DocumentView(corpus, shards, holdout, True, cut=stream.cut)
            documents, total = stream.documents, stream.starts[-1]
        digest = corpus.fingerprint()
        # max_tokens and eval.fraction (with the hash that picked the held-out documents)
        held_by = "" if holdout is None else f" by {HOLDOUT_HASH}"
        digest.update(f"{len(stream)} held out {holdout}{held_by}".encode())
        summary = CorpusSummary(
            corpus.describe(),
            documents,
            len(stream),
            total,
            truncated=len(stream) < total,
            fingerprint=digest.hexdigest(),
        )
        return stream, summary, held
    tokens, held_tokens, documents, truncated = pack_split(
        iter_documents(cfg), tokenizer, cfg.max_tokens, holdout
    )
    if not len(tokens):
        raise DataError(f"data.source={cfg.source!r} data.path={cfg.path!r}: the corpus is empty")
    source = cfg.source if cfg.path is None else f"{cfg.source} ({cfg.path})"
    corpus_tokens = None if truncated else len(tokens)
    digest = hashlib.sha256(repr(tokenizer_id(tokenizer)).encode())
    digest.update(memoryview(tokens.tokens))
    summary = CorpusSummary(
        source, documents, len(tokens), corpus_tokens, truncated, digest.hexdigest()
    )
    return tokens, summary, held_tokens if holdout is not None else None
