"""Helpers for the hyper-parameter dataclasses of the models."""

from dataclasses import field


def arg(default, doc: str):
    """A dataclass field with a one-line doc that `train.py --help` prints."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": doc})
    return field(default=default, metadata={"help": doc})
