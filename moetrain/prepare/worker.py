"""One work unit of `python -m moetrain.prepare`: read a slice of the corpus, tokenize it and
write it as one shard (the format of moetrain/data/shards.py), then a done marker.

It runs in worker processes, so it never imports torch (seconds and hundreds of MB per
process); what it needs comes in the `job` dict that moetrain/prepare/run.py builds. It reads
by the rules of `moetrain.data.reader`, the same as the in-memory sources, so that both give
the same documents in the same order.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from moetrain.data import hf_rows, reader, shards
from moetrain.data.reader import COMMAND_LINE
from moetrain.data.shards import file_sha256
from moetrain.data.utf8 import OnReplaced, Replaced
from moetrain.errors import DataError
from moetrain.fileio import read_json, write_atomic
from moetrain.prepare import long_docs, truncate
from moetrain.prepare.encode import BATCH_CHARS, Encoder, encode_or_explain, encoder_of
from moetrain.prepare.unit_files import (  # noqa: F401  (worker.Job and the rest: run.py, work_plan.py)
    WORK_DIR,
    Job,
    Report,
    ShardWriter,
    line_number,
    load_hf,
    marker_path,
    replaced_fields,
    shard_name,
)

# --- reading documents: moetrain.data.reader's rules, with progress in input bytes -----------


def _jsonl_documents(job: Job, unit: dict, replaced: OnReplaced) -> Iterator[tuple[Any, int]]:
    """(text or a long one's TextStream, input bytes consumed): "" carries only progress."""
    for file_index, start, end in unit["pieces"]:
        path, field, long = job["files"][file_index], job["text_field"], long_docs.STREAM_BYTES
        yield from reader.jsonl_documents(path, field, COMMAND_LINE, start, end, long, replaced)


def _text_documents(job: Job, unit: dict, replaced: OnReplaced) -> Iterator[tuple[Any, int]]:
    for file_index, start, end in unit["pieces"]:
        path = job["files"][file_index]
        yield reader.text_document(path, long_docs.STREAM_BYTES, replaced), end - start


def _hf_documents(job: Job, unit: dict, replaced: OnReplaced) -> Iterator[tuple[str, int]]:
    # (`replaced`: never called; a dataset's rows are text already)
    field, path = job["text_field"], job["hf"]["path"]
    lo, hi = unit["rows"]
    # Row ranges have no exact byte size: spread the unit's estimate over its rows.
    per_row = unit["bytes"] / max(1, hi - lo)
    done = 0
    ds = load_hf(path, job["hf"]["split"], field)
    for row, (text, _) in enumerate(hf_rows.hf_documents(ds, field, path, lo, hi), start=1):
        yield text, int(per_row * row) - done
        done = int(per_row * row)


# --- tokenizing and writing ------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(job: Job) -> Any:
    """The job's `tokenizers.Tokenizer`, loaded once per worker; None: the byte tokenizer."""
    path = job["tokenizer_path"]
    if path is not None and path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[path] = Tokenizer.from_file(path)
    return _TOKENIZERS.get(path)


def _encode_or_explain(encode: Encoder, batch: list[str], job: Job, unit: dict) -> tuple:
    def where() -> str:
        files = {job["files"][piece[0]] for piece in unit.get("pieces", [])}
        return ", ".join(sorted(files)) or f"{job['hf']['path']} rows {unit.get('rows')}"

    return encode_or_explain(encode, batch, where)


def intact_marker(job: Job, index: int) -> dict | None:
    """The unit's done marker if it belongs to this plan and its files match it byte for byte."""
    marker = read_json(marker_path(job["out"], index))
    if not isinstance(marker, dict) or marker.get("unit") != job["units"][index]:
        return None
    base = os.path.join(job["out"], shard_name(index))
    width = np.dtype(job["dtype"]).itemsize
    try:
        nbytes = width * marker["tokens"]
        files = [
            (base + shards.TOKENS_SUFFIX, nbytes, marker["sha256"]),
            (base + shards.DOCS_SUFFIX, 8 * marker["documents"], marker["docs_sha256"]),
            (
                base + shards.CRC_SUFFIX,
                4 * shards.crc_entries(nbytes, job["block_bytes"]),
                marker["crc_sha256"],
            ),
        ]
        if job["format"] != "text":  # instruction data: the loss mask and its table too
            n = marker["tokens"]
            files += [
                (base + shards.MASK_SUFFIX, n, marker["mask_sha256"]),
                (
                    base + shards.MASK_CRC_SUFFIX,
                    4 * shards.crc_entries(n, job["block_bytes"]),
                    marker["mask_crc_sha256"],
                ),
            ]
    except (KeyError, TypeError):
        return None  # not a marker this code wrote
    for path, size, digest in files:
        if not os.path.isfile(path) or os.path.getsize(path) != size or file_sha256(path) != digest:
            return None
    return marker


def run_unit(
    job: Job, index: int, report: Report, alive: Callable[[], bool] = lambda: True
) -> dict:
    """Unit `index` as its done marker plus "reused"; {"error": message} for bad input."""
    unit = job["units"][index]
    marker = intact_marker(job, index)
    if marker is not None:
        report(unit["bytes"], marker["documents"], marker["tokens"], False)
        return {**marker, "reused": True}
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker_path(job["out"], index))  # its files are about to be replaced
    if job["format"] != "text":
        from moetrain.prepare.instruction_unit import run_instruction_unit

        return run_instruction_unit(job, index, report, alive)
    read = {"jsonl": _jsonl_documents, "text": _text_documents, "hf_datasets": _hf_documents}
    replaced = Replaced()
    documents = read[job["kind"]](job, unit, replaced)
    tok = _tokenizer(job)
    encode = encoder_of(tok)
    writer = ShardWriter(
        job["out"], shard_name(index), job["dtype"], job["eos_id"], job["block_bytes"]
    )
    batch: list[str] = []
    chars = nbytes = 0
    keep, cuts = job["truncate"], truncate.Cuts()  # --truncate: tokens a document keeps

    def flush() -> None:
        nonlocal batch, chars, nbytes
        tokens = 0
        if batch:
            flat, lengths = _encode_or_explain(encode, batch, job, unit)
            tokens = writer.add(*truncate.fit_text(flat, lengths, keep, cuts))
        report(nbytes, len(batch), tokens, True)
        batch, chars, nbytes = [], 0, 0
        if not alive():
            raise SystemExit(1)  # the main process is gone: stop, leave no marker

    try:
        for text, consumed in documents:
            nbytes += consumed
            if isinstance(text, reader.TextStream):  # a long document, tokenized in pieces
                flush()
                cuts.truncated += long_docs.write(text, writer, tok, report, alive, keep)
            elif text:
                batch.append(text)
                chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
        flush()
        marker = {"unit": unit, **writer.finish(), **replaced_fields(replaced), **cuts.fields()}
    except DataError as err:
        writer.abort()
        return {"error": str(err)}
    except BaseException:
        writer.abort()
        raise
    write_atomic(marker_path(job["out"], index), json.dumps(marker, indent=1))
    return {**marker, "reused": False}


def serve(job: Job, tasks: Any, events: Any, stop: Any, progress: bool) -> None:
    """A worker process: run the unit indices from `tasks` until None; send events
    ("progress", bytes, docs, tokens, fresh), ("done", index, result), ("crash", index, tb)."""
    # N workers each starting N tokenizer threads would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    parent = mp.parent_process()

    def alive() -> bool:
        return parent is None or parent.is_alive()

    def report(nbytes: int, docs: int, tokens: int, fresh: bool) -> None:
        if progress:
            events.put(("progress", nbytes, docs, tokens, fresh))

    while (index := tasks.get()) is not None and not stop.is_set() and alive():
        try:
            events.put(("done", index, run_unit(job, index, report, alive)))
        except Exception:
            events.put(("crash", index, traceback.format_exc()))
            return
