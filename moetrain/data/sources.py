"""Document sources of the in-memory path: each yields documents (str) in an order that
depends only on the files, read by the rules of `moetrain.data.reader`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from moetrain.config import DataSection
from moetrain.data import hf_rows, reader
from moetrain.data.reader import CONFIG
from moetrain.errors import DataError

# Test suites are huge, repetitive and partly in odd encodings; site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted by path relative to the stdlib root."""
    root = Path(os.__file__).resolve().parent
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def source_files(data_cfg: DataSection) -> list[str] | None:
    """The files an in-memory file source reads (None for hf_datasets, which is not files)."""
    if data_cfg.source == "stdlib":
        return [str(p) for p in stdlib_files()]
    if data_cfg.source in _WHAT:
        return _files(data_cfg)
    return None


_WHAT = {"text": "text files", "jsonl": "JSON-lines files"}


def _files(data_cfg: DataSection) -> list[str]:
    if not data_cfg.path:
        raise DataError(f"data.source={data_cfg.source!r} needs data.path: a glob of files")
    return reader.glob_files(data_cfg.path, _WHAT[data_cfg.source], CONFIG)


def iter_documents(data_cfg: DataSection) -> Iterator[str]:
    """Documents of the configured source. Path problems are raised here, not on first read."""
    source = data_cfg.source
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(f"found no .py files next to {os.__file__} for data.source='stdlib'")
        return (reader.read_text(f) for f in files)
    if source == "text":
        return (reader.read_text(f) for f in _files(data_cfg))
    if source == "jsonl":
        field = data_cfg.text_field
        files = _files(data_cfg)
        return (t for f in files for t, _ in reader.jsonl_documents(f, field, CONFIG) if t)
    if source == "hf_datasets":
        if not data_cfg.path:
            raise DataError(
                "data.source='hf_datasets' needs data.path: a dataset name or directory"
            )
        field = data_cfg.text_field
        ds = hf_rows.load_hf_dataset(data_cfg.path, data_cfg.hf_split, field, CONFIG)
        return (t for t, _ in hf_rows.hf_documents(ds, field, data_cfg.path, 0, len(ds)) if t)
    raise DataError(f"unknown data.source={source!r}; use stdlib, text, jsonl or hf_datasets")
