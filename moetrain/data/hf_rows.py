"""Rows of a Hugging Face dataset as documents: a saved directory, a `load_dataset` name or
folder, or one data file (.parquet, .jsonl, .json, .csv, .arrow, .txt), one text column (`--text-field`), or a conversation's columns for `--format chat`. The
rules of `moetrain.data.reader`, for `datasets` tables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from moetrain.data.reader import Options
from moetrain.errors import DataError

HF_ROWS = 1024  # rows per read of a datasets table

# datasets' packaged builder for a data file, by its extension: load_dataset reads a folder
# or a hub name by itself, but a single file only through the builder of its format.
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}


def load_hf_dataset(path: str, split: str, field: str | None, opts: Options) -> Any:
    """The `datasets.Dataset` of one column (a saved directory, or load_dataset's name); for
    `field` None, the columns of a conversation (`chat_columns`)."""
    ds = _open_hf_dataset(path, split, opts)
    if field is None:
        return ds.select_columns(chat_columns(ds.column_names, f"{opts.path}={path!r}"))
    if field not in ds.column_names:
        raise DataError(
            f"{opts.path}={path!r} has columns {ds.column_names}, no {field!r}: set "
            f"{opts.text_field}"
        )
    return ds.select_columns([field])


def chat_columns(columns: list[str], where: str) -> list[str]:
    """The columns that hold a conversation: `messages` or ShareGPT's `conversations`, and
    `tools` if there is one (moetrain/prepare/chat_messages.py reads them); or a preference
    pair's: `chosen`, `rejected` and `prompt` if there is one (moetrain/prepare/preference.py)."""
    tools = ["tools"] if "tools" in columns else []
    for name in ("messages", "conversations"):
        if name in columns:
            return [name, *tools]
    if "chosen" in columns and "rejected" in columns:
        return [c for c in ("prompt", "chosen", "rejected") if c in columns] + tools
    raise DataError(
        f"{where} has the columns {columns}, none of which holds conversations: --format chat "
        "reads a 'messages' column (a list of {role, content}) or ShareGPT's 'conversations' "
        "(a list of {from, value}), --format preference 'chosen' and 'rejected' (and "
        "'prompt'), each with an optional 'tools' column"
    )


def _open_hf_dataset(path: str, split: str, opts: Options) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset needs the optional `datasets` package (pip "
            "install datasets)"
        ) from None
    local = os.path.expanduser(path)
    saved_markers = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, m)) for m in saved_markers):
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(
                    f"{opts.path}={path!r} has splits {list(ds)}, not {split!r}: set {opts.split}"
                )
            ds = ds[split]
    elif local.startswith(("/", ".", "~")) and not os.path.exists(local):
        raise DataError(f"{opts.path}={path!r} does not exist (looked for a dataset directory)")
    elif os.path.isfile(local):
        ds = _load(datasets, path, split, opts, _file_builder(path, split, opts), local)
    else:
        ds = _load(datasets, path, split, opts, local, None)
    return ds


def _file_builder(path: str, split: str, opts: Options) -> str:
    """The builder that reads the data file `path`; DataError for a format it cannot, or
    for a split other than the one a lone file makes."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_BUILDERS:
        raise DataError(
            f"{opts.path}={path!r} is a file datasets has no reader for by its extension: "
            f"name a {', '.join(FILE_BUILDERS)} file, a folder of them, or a directory "
            "written by save_to_disk"
        )
    if split != "train":
        raise DataError(
            f"{opts.path}={path!r} is one data file, which datasets reads as the split "
            f"'train' alone, not {split!r}: set {opts.split}=train (the default), or name a "
            "folder whose files are named by split"
        )
    return FILE_BUILDERS[extension]


def _load(datasets: Any, path: str, split: str, opts: Options, name: str, files: str | None) -> Any:
    """datasets.load_dataset(name, data_files=files, split=split), its failures refused."""
    try:
        return datasets.load_dataset(name, data_files=files, split=split)
    except Exception as err:  # datasets raises many kinds; all mean the same to the user
        raise DataError(
            f"datasets.load_dataset({opts.path}={path!r}, split={split!r}) failed: {err}; "
            f"check {opts.path} and {opts.split}"
        ) from None


def hf_documents(ds: Any, field: str, name: str, lo: int, hi: int) -> Iterator[tuple[str, int]]:
    """(text, 1) for each row of [lo, hi) of a one-column dataset (`load_hf_dataset`): text
    "" for an empty or None row, which readers skip. `name` says where, for errors."""
    for a in range(lo, hi, HF_ROWS):
        b = min(a + HF_ROWS, hi)
        texts = ds[a:b][field]  # a column slice: much faster than one row dict at a time
        for row, text in enumerate(texts, start=a):
            if text and not isinstance(text, str):
                raise DataError(
                    f"{name} row {row}: column {field!r} holds {type(text).__name__}, not text; "
                    "choose a text column"
                )
            yield text or "", 1
