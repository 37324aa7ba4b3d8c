"""`python -m moetrain.prepare --show N --out DIR`: what training reads from a prepared
directory, for a person: its first N documents decoded, the trained tokens (the loss mask's
targets) between OPEN and CLOSE, and each document's trained and total token counts.

The tokens and masks are read as training reads them (`moetrain.data.prepared`), their
blocks' checksums checked. They are decoded with the tokenizer the manifest records: its
`--tokenizer` (or the one given, which must be the same file, by its sha256), special tokens
shown as text, so the end-of-turn tokens a chat trains show where they are.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator

import numpy as np

from moetrain.data.prepared import PreparedCorpus
from moetrain.data.shards import Manifest, file_sha256
from moetrain.errors import DataError

OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: brackets that text and templates hardly hold
Decode = Callable[[np.ndarray], str]


def recorded_tokenizer(manifest: Manifest) -> str | None:
    """The --tokenizer of the command that prepared the directory (None: none recorded)."""
    words = shlex.split(manifest.command)
    at = words.index("--tokenizer") + 1 if "--tokenizer" in words else len(words)
    return words[at] if at < len(words) else None


def _byte_decoder(eos_id: int) -> Decode:
    """The byte tokenizer's ids as text: the UTF-8 bytes, and its EOS (no byte) as <eos>."""

    def decode(ids: np.ndarray) -> str:
        parts, start = [], 0
        for end in [*np.flatnonzero(ids == eos_id).tolist(), len(ids)]:
            parts.append(bytes(ids[start:end].astype(np.uint8)).decode("utf-8", "replace"))
            parts.append("<eos>" if end < len(ids) else "")
            start = end + 1
        return "".join(parts)

    return decode


def decoder(manifest: Manifest, out: str, given: str | None) -> Decode:
    """How to decode the directory's ids: with the tokenizer that made them, from `given`
    (--tokenizer) or from the manifest's command; DataError naming the fix otherwise."""
    theirs = manifest.tokenizer
    if theirs.kind == "byte":
        if given not in (None, "byte"):
            raise DataError(
                f"--out {out!r} was prepared with the byte tokenizer, not --tokenizer "
                f"{given!r}: leave --tokenizer out"
            )
        return _byte_decoder(theirs.eos_id)
    recorded = recorded_tokenizer(manifest)
    if given == "byte":
        raise DataError(
            f"--out {out!r} was prepared with a tokenizer.json (sha256 {theirs.sha256}), not "
            f"the byte tokenizer: leave --tokenizer out to decode with the one its manifest "
            f"records ({recorded}), or pass that tokenizer.json"
        )
    path = os.path.expanduser(given or recorded or "")
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not path or not os.path.isfile(file):
        if given or recorded:
            named = f"--tokenizer {given!r}" if given else f"its recorded --tokenizer {recorded!r}"
            why = f"{named} is neither a tokenizer.json nor a directory holding one"
        else:
            why = "its manifest records no --tokenizer"
        raise DataError(
            f"--out {out!r} was prepared with a tokenizer.json (sha256 {theirs.sha256}), and "
            f"{why}: pass --tokenizer with that tokenizer.json (or the model directory holding "
            "it) to decode its tokens"
        )
    if file_sha256(file) != theirs.sha256:
        raise DataError(
            f"{file} is not the tokenizer --out {out!r} was prepared with (sha256 "
            f"{file_sha256(file)}, the manifest's {theirs.sha256}): its ids would decode to "
            f"other text; pass --tokenizer with the one it was prepared with ({recorded})"
        )
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(file)
    except Exception as err:  # the tokenizers library raises a bare Exception
        raise DataError(
            f"{file} cannot be loaded ({err}): pass --tokenizer with the tokenizer.json the "
            "directory was prepared with"
        ) from None
    return lambda ids: tok.decode(ids.tolist(), skip_special_tokens=False)


def _documents(corpus: PreparedCorpus, count: int) -> Iterator[tuple[int, int]]:
    """[start, end) in the token stream of the first `count` documents, reading the document
    tables shard by shard (only as many as needed)."""
    base, start, shown = 0, 0, 0
    for i, shard in enumerate(corpus.manifest.shards):
        for end in (corpus.shard_document_ends(i) + base).tolist():
            if shown == count:
                return
            yield start, end
            start, shown = end, shown + 1
        base += shard.tokens


def marked_text(ids: np.ndarray, trained: np.ndarray, decode: Decode) -> str:
    """The decoded document, each run of trained tokens between OPEN and CLOSE."""
    edges = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    parts = []
    for run in np.split(np.arange(len(ids)), edges):
        if len(run):
            text = decode(ids[run])
            parts.append(f"{OPEN}{text}{CLOSE}" if trained[run[0]] else text)
    return "".join(parts)


def show(out: str, count: int, tokenizer: str | None) -> Iterator[str]:
    """The lines that `--show count` prints (see the module)."""
    corpus = PreparedCorpus.open(out, key="--out")
    decode = decoder(corpus.manifest, out, tokenizer)
    tokens = corpus.tokens()
    masks = corpus.masks() if corpus.loss_mask else None
    yield (
        f"{out}: {corpus.num_documents:,} documents, {corpus.num_tokens:,} tokens; the first "
        f"{min(count, corpus.num_documents):,}, "
        + (
            f"trained tokens (the loss mask's targets) between {OPEN} and {CLOSE}"
            if masks is not None
            else "all of whose tokens are trained (text: no loss mask)"
        )
    )
    for index, (start, end) in enumerate(_documents(corpus, count)):
        ids = np.asarray(tokens[start:end]).astype(np.int64)
        trained = np.ones(len(ids), bool) if masks is None else masks[start:end] != 0
        n = int(trained.sum())
        yield (
            f"--- document {index}: {len(ids):,} tokens, {n:,} trained "
            f"({n / max(len(ids), 1):.1%}) ---"
        )
        yield marked_text(ids, trained, decode) if masks is not None else decode(ids)
