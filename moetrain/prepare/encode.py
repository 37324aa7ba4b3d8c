"""Text to token ids in `python -m moetrain.prepare`'s workers: one encoder for the batched
documents (moetrain/prepare/worker.py) and the pieces of streamed ones (long_docs.py)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np

from moetrain.errors import DataError

BATCH_CHARS = 1 << 20  # text per tokenizer call: bounds a worker's memory, amortises the call

Encoder = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]  # -> (flat ids, lengths)


def encoder_of(tok: Any) -> Encoder:
    """Texts -> (their ids concatenated, each one's length), with `tok` (a
    `tokenizers.Tokenizer`) or, for None, the byte tokenizer (ids = the UTF-8 bytes)."""
    if tok is None:

        def encode_bytes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            encoded = [t.encode("utf-8") for t in texts]
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            return np.frombuffer(b"".join(encoded), np.uint8), lengths

        return encode_bytes

    def encode_hf(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # The call HFTokenizer.encode_batch makes: no special tokens, EOS is added by us.
        ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

    return encode_hf


def encode_or_explain(
    encode: Encoder, texts: list[str], where: Callable[[], str]
) -> tuple[np.ndarray, np.ndarray]:
    """`encode(texts)`, or a DataError naming `where()` the document that broke it."""
    try:
        return encode(texts)
    except Exception as err:  # e.g. a lone surrogate ("\\ud800" in JSON) has no UTF-8 bytes
        raise DataError(
            f"{where()}: the tokenizer failed on a document ({type(err).__name__}: {err}); "
            "repair or remove that document"
        ) from None
