"""Document sources: each yields documents (str) in an order that depends only on the files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path

from trainer.config import DataSection
from trainer.data.batch import DataError

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


def _read_text(path: str | os.PathLike) -> str:
    # A stray invalid byte should not stop a training run.
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _glob_files(pattern: str | None, source: str, what: str) -> list[str]:
    if not pattern:
        raise DataError(f"data.source={source!r} needs data.path: a glob of {what}")
    expanded = os.path.expanduser(pattern)
    files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not files:
        hint = ""
        if os.path.isdir(expanded):
            hint = f" ({expanded!r} is a directory; try '{expanded.rstrip('/')}/**/*')"
        raise DataError(
            f"data.path={pattern!r} matched no files (looked for {what} matching that glob, "
            f"relative to {os.getcwd()!r} unless absolute){hint}"
        )
    return files


def jsonl_field_problem(file: str, lineno: int, record: object, field: str) -> str:
    """The refusal of a JSON line without the text field: where, and what it has instead."""
    if not isinstance(record, dict):
        return (
            f"{file}:{lineno}: a JSON {type(record).__name__}, not an object with a {field!r} field"
        )
    has = ", ".join(map(repr, list(record)[:10])) or "none"
    return (
        f"{file}:{lineno}: no field {field!r} in this line (it has: {has}); set data.text_field "
        "to the field that holds the text"
    )


def _jsonl_documents(files: list[str], field: str) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{lineno}: not valid JSON ({e})") from e
                if not isinstance(record, dict) or field not in record:
                    raise DataError(jsonl_field_problem(file, lineno, record, field))
                text = record[field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{file}:{lineno}: field {field!r} is {type(text).__name__}, not a string"
                    )
                yield text


def _hf_documents(path: str | None, split: str, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            "data.source='hf_datasets' needs the optional `datasets` package (pip install datasets)"
        ) from e
    if not path:
        raise DataError("data.source='hf_datasets' needs data.path: a dataset name or directory")
    local = os.path.expanduser(path)
    saved_markers = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, m)) for m in saved_markers):
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.path={path!r} has splits {list(ds)}, not {split!r}")
            ds = ds[split]
    elif local.startswith(("/", ".", "~")) and not os.path.exists(local):
        raise DataError(f"data.path={path!r} does not exist (looked for a dataset directory)")
    else:
        try:
            ds = datasets.load_dataset(local, split=split)
        except Exception as e:  # datasets raises many kinds; all mean the same to the user
            raise DataError(
                f"datasets.load_dataset(data.path={path!r}, split={split!r}) failed: {e}"
            ) from e
    if field not in ds.column_names:
        raise DataError(f"data.path={path!r} has columns {ds.column_names}, no {field!r}")

    def documents() -> Iterator[str]:
        # Column batches are much faster to read than one row dict at a time.
        for batch in ds.select_columns([field]).iter(batch_size=1024):
            yield from (text for text in batch[field] if text)

    return documents()


def source_files(data_cfg: DataSection) -> list[str] | None:
    """The files an in-memory file source reads (None for hf_datasets, which is not files)."""
    if data_cfg.source == "stdlib":
        return [str(p) for p in stdlib_files()]
    if data_cfg.source == "text":
        return _glob_files(data_cfg.path, "text", "text files")
    if data_cfg.source == "jsonl":
        return _glob_files(data_cfg.path, "jsonl", "JSON-lines files")
    return None


def iter_documents(data_cfg: DataSection) -> Iterator[str]:
    """Documents of the configured source. Path problems are raised here, not on first read."""
    source = data_cfg.source
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(f"found no .py files next to {os.__file__} for data.source='stdlib'")
        return (_read_text(f) for f in files)
    if source == "text":
        return (_read_text(f) for f in _glob_files(data_cfg.path, source, "text files"))
    if source == "jsonl":
        files = _glob_files(data_cfg.path, source, "JSON-lines files")
        return _jsonl_documents(files, data_cfg.text_field)
    if source == "hf_datasets":
        return _hf_documents(data_cfg.path, data_cfg.hf_split, data_cfg.text_field)
    raise DataError(f"unknown data.source={source!r}; use stdlib, text, jsonl or hf_datasets")
