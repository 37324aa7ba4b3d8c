"""A synthetic corpus for the data benchmarks (benchmarks/data.py): JSON-lines documents of
random words (Zipf-distributed vocabulary, lognormal document lengths, some 2-byte UTF-8),
written fast in numpy, and a byte-level BPE trained on a slice of it."""

from __future__ import annotations

import json
import os
import time

import numpy as np

MIB = 1 << 20
PREFIX = b'{"text": "'
SEP = b'."}\n' + PREFIX  # ends one document and starts the next
LETTERS = list("etaoinshrdlcumwfgypbvkéjxqüzß")  # most frequent first; some 2-byte UTF-8


def word_table(rng: np.random.Generator, n: int = 30000):
    """Vocabulary words (Zipf-distributed), three joiners and SEP, as one byte table."""
    lens = np.clip(rng.poisson(5, n) + 1, 1, 14)
    weights = 0.88 ** np.arange(len(LETTERS))
    chars = rng.choice(LETTERS, size=int(lens.sum()), p=weights / weights.sum())
    words = [("".join(w)).encode() for w in np.split(chars, np.cumsum(lens)[:-1])]
    entries = words + [b" ", b", ", b". ", SEP]
    lengths = np.array([len(e) for e in entries], np.int64)
    offsets = np.cumsum(lengths) - lengths
    table = np.frombuffer(b"".join(entries), np.uint8)
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** 1.1)
    return table, offsets, lengths, cdf / cdf[-1]


def generate(path: str, mib: float, seed: int, chunk_bytes: int = 8 * MIB) -> int:
    """A jsonl file of about `mib` MiB of documents of random words (lognormal lengths)."""
    rng = np.random.default_rng(seed)
    table, offsets, lengths, cdf = word_table(rng)
    n = len(cdf)
    per_word = float((lengths[:n] * np.diff(cdf, prepend=0)).sum()) + 1.2
    target, written = int(mib * MIB), 0
    with open(path, "wb") as f:
        f.write(PREFIX)
        while written < target:
            budget = min(chunk_bytes, target - written) / per_word
            draws = rng.lognormal(np.log(300), 1.0, int(budget / 400) + 8)  # words per doc
            doc_words = np.clip(draws, 5, 20000).astype(np.int64)
            doc_words = doc_words[: np.searchsorted(doc_words.cumsum(), budget) + 1]
            total = int(doc_words.sum())
            ids = np.empty(2 * total, np.int64)
            ids[0::2] = np.searchsorted(cdf, rng.random(total))
            joiners = n + rng.choice(3, total, p=[0.85, 0.08, 0.07])
            joiners[np.cumsum(doc_words) - 1] = n + 3  # SEP after each document's last word
            ids[1::2] = joiners
            ln = lengths[ids]
            ends = np.cumsum(ln)
            pos = np.repeat(offsets[ids] - (ends - ln), ln) + np.arange(int(ends[-1]))
            f.write(table[pos].tobytes())
            written += int(ends[-1])
        f.truncate(f.tell() - len(PREFIX))  # the file ends with a document's end, '."}\n'
    return os.path.getsize(path)


def read_texts(path: str, limit: int | None = None) -> list[str]:
    texts, size = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if limit is not None and size >= limit:
                break
    return texts


def train_bpe(texts: list[str], vocab: int, out: str) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # as GPT-2 and later
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(out)
    return time.perf_counter() - start
