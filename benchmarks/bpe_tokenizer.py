"""A byte-level BPE tokenizer trained on the standard library's source, for GPU proxies.

    python benchmarks/bpe_tokenizer.py --vocab 32000 --out DIR   (writes DIR/tokenizer.json)

Why: the byte tokenizer gives a model at most 257 distinct ids. At a random init most of
a token's hidden state then comes from what its few neighbours share, so every token's
router sees nearly the same input and picks the same experts (the first H100 proxy's
expert load max/mean was 15.9 of a possible 16). A BPE vocabulary of tens of thousands
of ids, as a real corpus gives, spreads the routers' inputs. No download: the tokenizer is
trained here on the Python standard library (`data.source = "stdlib"`), the same text
the proxy then trains on (`--data.tokenizer=DIR/tokenizer.json`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.data.sources import stdlib_files  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    files = [str(f) for f in stdlib_files()]
    tok.train(files, trainer)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tokenizer.json")
    tok.save(path)
    sample = open(files[0], encoding="utf-8", errors="replace").read()[:20000]
    ids = tok.encode(sample).ids
    print(f"{path}: vocab {tok.get_vocab_size()}, {len(sample) / len(ids):.2f} chars per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
