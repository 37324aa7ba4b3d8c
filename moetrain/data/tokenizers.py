"""Tokenizers: raw UTF-8 bytes (no file needed) or a Hugging Face tokenizer.json."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from moetrain.config import DataSection
from moetrain.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> Sequence[int] | np.ndarray: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is EOS: needs no vocabulary file."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        # One C-level conversion instead of a Python loop per byte.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class HFTokenizer:
    """A `tokenizers` tokenizer.json (as shipped with most Hugging Face models)."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _RawTokenizer
        except ImportError as e:
            raise DataError(
                "data.tokenizer names a tokenizer.json, which needs the `tokenizers` package "
                "(pip install tokenizers)"
            ) from e
        path = Path(path)
        if path.is_dir():  # a model directory: use the tokenizer.json inside it
            path = path / "tokenizer.json"
        self.path = path
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist (data.tokenizer)")
        try:
            self._tok = _RawTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise DataError(
                f"{path} is not a valid tokenizer.json ({e}); data.tokenizer takes 'byte' or "
                "the tokenizer.json of a Hugging Face model (or its directory)"
            ) from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int:
        if eos_token is not None:
            eos_id = self._tok.token_to_id(eos_token)
            if eos_id is None:
                raise DataError(f"data.eos_token={eos_token!r} is not in tokenizer {self.path}")
            return eos_id
        for name in COMMON_EOS_TOKENS:
            eos_id = self._tok.token_to_id(name)
            if eos_id is not None:
                return eos_id
        raise DataError(
            f"tokenizer {self.path} has none of the usual EOS tokens {COMMON_EOS_TOKENS}; "
            "set data.eos_token to the token that ends a document"
        )

    # Special tokens (e.g. a BOS added by a post-processor) are left out: packing adds the
    # one separator we want, EOS, after every document.
    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The Rust side tokenizes a batch on several threads: much faster than one by one.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(data_cfg: DataSection) -> Tokenizer:
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    if not os.path.exists(os.path.expanduser(data_cfg.tokenizer)):
        raise DataError(
            f"data.tokenizer={data_cfg.tokenizer!r} is neither 'byte' nor an existing "
            "tokenizer.json (or a directory holding one)"
        )
    return HFTokenizer(os.path.expanduser(data_cfg.tokenizer), data_cfg.eos_token)
