"""One work unit of `prepare --format chat|prompt_completion|preference`: lines of JSON (or rows of a
Hugging Face dataset) to documents with a loss mask (`moetrain.prepare.instructions`),
written as one shard with them.

A conversation may give several documents (`--chat-turns per_turn`: one per answer), and
each document says whether the EOS written after it is a target (its last answer's stop
target, for a template without end-of-turn text; a completion's EOS). The unit's marker
counts the conversations by the mode that rendered them, and the tokens that cost
(`chat_turns`), which the run adds up for its summary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from moetrain.data import hf_rows, reader
from moetrain.data.utf8 import OnReplaced, Replaced, decode_lines
from moetrain.errors import DataError
from moetrain.fileio import write_atomic
from moetrain.prepare import instructions, preference, truncate
from moetrain.prepare.encode import BATCH_CHARS
from moetrain.prepare.unit_files import (
    Job,
    Report,
    ShardWriter,
    line_number,
    load_hf,
    marker_path,
    replaced_fields,
    shard_name,
)

Docs = list[tuple[np.ndarray, np.ndarray, int]]  # (ids, mask, EOS a target) per document


def _lines(job: Job, unit: dict, replaced: OnReplaced) -> Iterator[tuple[Any, int]]:
    """((documents, chat mode), input bytes consumed) of `--format chat|prompt_completion`
    lines; None carries only progress. Lines are read as `reader.jsonl_documents` reads
    them."""
    for file_index, start, end in unit["pieces"]:
        path = job["files"][file_index]
        lineno = 0
        for chunk in reader.line_chunks(path, start, end, instructions.MAX_LINE_BYTES):
            if not isinstance(chunk, bytes):  # a line over the limit: refused, never read whole
                where = f"{path}:{line_number(path, start, lineno + 1)}"
                raise instructions.too_long(job["format"], where)

            def replaced_line(
                index: int, n: int = lineno, path: str = path, a: int = start
            ) -> None:
                replaced(lambda: f"{path}:{line_number(path, a, n + index + 1)}")

            text = decode_lines(chunk, replaced_line)
            if "\r" in text:  # universal newlines, as in text mode
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            for line in text.split("\n")[: -1 if text.endswith("\n") else None]:
                lineno += 1
                if line.strip():

                    def where(n: int = lineno, path: str = path, start: int = start) -> str:
                        return f"{path}:{line_number(path, start, n)}"

                    record = instructions.parse(line, where)
                    yield instructions.documents(job, record, where), 0
            yield None, len(chunk)


def _rows(job: Job, unit: dict, replaced: OnReplaced) -> Iterator[tuple[Any, int]]:
    """As `_lines`, for the rows of a Hugging Face dataset (`--source hf_datasets`)."""
    path, (lo, hi) = job["hf"]["path"], unit["rows"]
    ds = load_hf(path, job["hf"]["split"], None)  # the conversation's columns
    per_row = unit["bytes"] / max(1, hi - lo)  # rows have no byte size: the unit's estimate
    done = 0
    for a in range(lo, hi, hf_rows.HF_ROWS):
        b = min(a + hf_rows.HF_ROWS, hi)
        columns = ds[a:b]
        for k in range(b - a):
            record = {name: values[k] for name, values in columns.items()}
            yield instructions.documents(job, record, f"{path} row {a + k}"), 0
        yield None, int(per_row * (b - lo)) - done
        done = int(per_row * (b - lo))


def run_instruction_unit(job: Job, index: int, report: Report, alive: Callable[[], bool]) -> dict:
    """`worker.run_unit` for `--format chat|prompt_completion`."""
    unit = job["units"][index]
    name = shard_name(index)
    replaced = Replaced()
    writer = ShardWriter(job["out"], name, job["dtype"], job["eos_id"], job["block_bytes"], True)
    docs: Docs = []
    pending = nbytes = 0
    modes = {"conversations": {}, "documents": 0, "tokens": 0, "one_rendering": 0}
    cuts = truncate.Cuts()  # --truncate: the documents cut to fit, and those left out

    def flush() -> None:
        nonlocal docs, pending, nbytes
        tokens = 0
        if docs:
            lengths = np.fromiter((len(ids) for ids, _, _ in docs), np.int64, len(docs))
            flat = np.concatenate([ids for ids, _, _ in docs])
            masks = np.concatenate([m for _, m, _ in docs])
            eos = np.asarray([e for _, _, e in docs], dtype=np.uint8)
            tokens = writer.add(flat, lengths, masks, eos)
        report(nbytes, len(docs), tokens, True)
        docs, pending, nbytes = [], 0, 0
        if not alive():
            raise SystemExit(1)

    read = _rows if job["kind"] == "hf_datasets" else _lines
    try:
        for item, consumed in read(job, unit, replaced):
            nbytes += consumed
            if item is not None:
                rendered, mode = item
                if mode is not None:  # what each rendering mode cost (before --truncate)
                    modes["conversations"][mode] = modes["conversations"].get(mode, 0) + 1
                    modes["documents"] += len(rendered)
                    modes["tokens"] += sum(len(ids) + 1 for ids, *_ in rendered)
                    modes["one_rendering"] += len(rendered[-1][0]) + 1
                if job["format"] == "preference":  # a pair fits whole or is left out
                    new = preference.fit_pair(rendered, job["truncate"], cuts)
                else:
                    new = truncate.fit_instruction(rendered, job["truncate"], cuts)
                docs += new
                pending += sum(len(ids) for ids, _, _ in new)
            if pending >= BATCH_CHARS // 4:  # ~1 MB of text's tokens at a time
                flush()
        flush()
        marker = {"unit": unit, **writer.finish(), **replaced_fields(replaced), **cuts.fields()}
        if job["format"] == "chat":
            marker["chat_turns"] = modes
    except DataError as err:
        writer.abort()
        return {"error": str(err)}
    except BaseException:
        writer.abort()
        raise
    write_atomic(marker_path(job["out"], index), json.dumps(marker, indent=1))
    return {**marker, "reused": False}
