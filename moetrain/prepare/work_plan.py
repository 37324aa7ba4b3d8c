"""What `python -m moetrain.prepare` will do: the tokenizer's identity, the source files and
the work units, all deterministic functions of the corpus, the tokenizer and --shard-mb.

jsonl units are byte ranges cut at line ends near multiples of --shard-mb (small files
grouped), text units are whole files grouped up to --shard-mb, hf_datasets units row ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from typing import Any

from moetrain.data import reader, shards
from moetrain.data.reader import COMMAND_LINE
from moetrain.data.shards import TokenizerId
from moetrain.data.tokenizers import ByteTokenizer, HFTokenizer
from moetrain.errors import DataError
from moetrain.prepare import instructions, worker
from moetrain.prepare.chat_template import check_options, template_origin
from moetrain.prepare.chat_turns import Renderer

MIB = 1 << 20


@dataclass(frozen=True)
class PrepareArgs:
    source: str  # jsonl | text | hf_datasets
    path: str  # a glob of files, or a dataset directory / name
    tokenizer: str  # "byte" or a tokenizer.json (or a directory holding one)
    out: str
    workers: int | None = None  # None: os.cpu_count()
    text_field: str = "text"
    split: str = "train"
    eos_token: str | None = None
    shard_mb: float = 256.0  # target input MiB per work unit (= per shard)
    overwrite: bool = False
    progress: bool = False
    format: str = "text"  # text | chat | prompt_completion | preference (instructions.py)
    chat_template: str | None = None  # --format chat: a Jinja file instead of the tokenizer's
    chat_turns: str = "auto"  # --format chat: which renderings train the answers (chat_turns.py)
    chat_template_kwargs: str | None = None  # --format chat: the template's options, JSON
    truncate: int | None = None  # documents cut to fit a sample of this data.seq_len (truncate.py)
    tool_arguments: str = "auto"  # --format chat: tool-call arguments as object|string (chat_tools)

    def template_options(self) -> dict[str, Any]:
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


def repeat_command(args: PrepareArgs) -> str:
    """The command that prepares the same bytes again, without `--out` (the manifest records
    it so that a reader finding a damaged shard can name the repair): only what decides the
    bytes, with absolute paths, so that it does not depend on the directory or the workers."""

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path))

    words = ["python", "-m", "moetrain.prepare", "--source", args.source, "--path"]
    words.append(args.path if args.source == "hf_datasets" else absolute(args.path))
    tokenizer = args.tokenizer if args.tokenizer == "byte" else absolute(args.tokenizer)
    words += ["--tokenizer", tokenizer, "--text-field", args.text_field]
    if args.format != "text":
        words += ["--format", args.format]
    if args.chat_template is not None:
        words += ["--chat-template", absolute(args.chat_template)]
    if args.format == "chat":
        words += ["--chat-turns", args.chat_turns]
    if args.format in instructions.RENDERED:
        words += ["--tool-arguments", args.tool_arguments]
    if args.chat_template_kwargs is not None:  # compact and ordered: one text per meaning
        options = json.dumps(args.template_options(), sort_keys=True, separators=(",", ":"))
        words += ["--chat-template-kwargs", options]
    if args.source == "hf_datasets":
        words += ["--split", args.split]
    if args.eos_token is not None:
        words += ["--eos-token", args.eos_token]
    if args.truncate is not None:
        words += ["--truncate", str(args.truncate)]
    words += ["--shard-mb", f"{args.shard_mb:g}"]
    return shlex.join(words)


def tokenizer_identity(args: PrepareArgs) -> tuple[TokenizerId, str | None]:
    """The tokenizer's identity and the tokenizer.json that workers load (None: bytes)."""
    if args.tokenizer == "byte":
        tok = ByteTokenizer()
        return TokenizerId("byte", None, tok.vocab_size, tok.eos_id), None
    path = os.path.expanduser(args.tokenizer)
    if not os.path.exists(path):
        raise DataError(
            f"--tokenizer {args.tokenizer!r} does not exist: pass 'byte' or a tokenizer.json "
            "(or a model directory holding one)"
        )
    try:
        hf = HFTokenizer(path, args.eos_token)
    except DataError as err:  # worded for the config file; here the options are --flags
        message = str(err).replace("data.eos_token", "--eos-token")
        raise DataError(message.replace("data.tokenizer", "--tokenizer")) from None
    except Exception as err:  # the tokenizers library raises a bare Exception, e.g. for bad JSON
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        raise DataError(
            f"{file} is not a valid tokenizer.json ({err}): pass the tokenizer.json of a Hugging "
            "Face model (or one written by tokenizers.Tokenizer.save), or --tokenizer byte"
        ) from None
    file = str(hf.path.resolve())
    return TokenizerId("tokenizer.json", shards.file_sha256(file), hf.vocab_size, hf.eos_id), file


def _line_end(path: str, pos: int, size: int) -> int:
    """The offset just after the first "\\n" at or after `pos` (the file size if none)."""
    with open(path, "rb") as f:
        f.seek(pos)
        while pos < size and (block := f.read(64 << 10)):
            newline = block.find(b"\n")
            if newline >= 0:
                return pos + newline + 1
            pos += len(block)
    return size


def plan_file_units(files: list[str], sizes: list[int], target: int, split: bool) -> list[dict]:
    """Consecutive pieces [file, start, end) grouped into units of about `target` bytes.

    With `split` (jsonl) a file is cut at the first line end at or after the byte where the
    unit reaches `target`; else (text: a file is one document) a unit takes whole files
    while they fit, and at least one."""
    units: list[dict] = []
    pieces: list[list[int]] = []
    size_now = 0

    def close() -> None:
        nonlocal pieces, size_now
        if pieces:
            units.append({"pieces": pieces, "bytes": size_now})
        pieces, size_now = [], 0

    for index, (path, size) in enumerate(zip(files, sizes, strict=True)):
        if not split and size_now and size_now + size > target:
            close()
        pos = 0
        while pos < size:
            end = size
            if split and size - pos > target - size_now:
                end = _line_end(path, pos + target - size_now - 1, size)
            pieces.append([index, pos, end])
            size_now += end - pos
            pos = end
            if size_now >= target:
                close()
    close()
    return units


def _chat_source(args: PrepareArgs) -> dict[str, Any]:
    """What decides a chat corpus' tokens besides its files: the template (a changed one is
    new data), its options (refused when the template cannot take them), which renderings
    train the answers, and the form of tool-call arguments (with what `auto` resolved to)."""
    if args.format not in instructions.RENDERED:
        return {}
    tok = instructions.chat_tokenizer(args.tokenizer, args.chat_template)
    origin = template_origin(args.tokenizer, args.chat_template)
    check_options(tok, args.template_options(), origin)
    renderer = Renderer(tok, args.template_options(), args.tool_arguments, origin)
    return {
        "format": args.format,
        "chat_template_sha256": hashlib.sha256(str(tok.chat_template).encode()).hexdigest(),
        **({"chat_turns": args.chat_turns} if args.format == "chat" else {}),
        "chat_template_kwargs": args.template_options(),
        "tool_arguments": args.tool_arguments,
        "tool_arguments_rendered": renderer.tool_arguments,
    }


def _length_source(args: PrepareArgs) -> dict[str, Any]:
    """--truncate: the sample length the documents were cut to fit (other data)."""
    return {} if args.truncate is None else {"truncate": args.truncate}


def plan_source(args: PrepareArgs, target: int) -> tuple[dict, list[str], list[dict]]:
    """(the manifest's "source", the files workers read, the units)."""
    if args.source in ("jsonl", "text"):
        what = "JSON-lines files" if args.source == "jsonl" else "text files"
        files = [os.path.abspath(p) for p in reader.glob_files(args.path, what, COMMAND_LINE)]
        stats = [os.stat(f) for f in files]
        source: dict[str, Any] = {
            "kind": args.source,
            "files": [
                {"path": f, "size": s.st_size, "mtime": s.st_mtime}
                for f, s in zip(files, stats, strict=True)
            ],
        }
        if args.source == "jsonl" and args.format == "text":
            source["text_field"] = args.text_field
        if args.format != "text":
            source["format"] = args.format
        source.update(_chat_source(args))
        source.update(_length_source(args))
        sizes = [s.st_size for s in stats]
        return source, files, plan_file_units(files, sizes, target, args.source == "jsonl")
    if args.source == "hf_datasets":
        chat = args.format in instructions.RENDERED  # a record's columns, not one text column
        ds = worker.load_hf(args.path, args.split, None if chat else args.text_field)
        cache = sorted({c["filename"] for c in ds.cache_files})
        local = os.path.expanduser(args.path)
        source = {
            "kind": "hf_datasets",
            "path": os.path.abspath(local) if os.path.exists(local) else args.path,
            "split": args.split,
            **({"columns": ds.column_names} if chat else {"text_field": args.text_field}),
            **_chat_source(args),
            **_length_source(args),
            "fingerprint": ds._fingerprint,  # what datasets itself uses to name a version
            "num_rows": ds.num_rows,
            "files": [
                {"path": c, "size": os.path.getsize(c), "mtime": os.path.getmtime(c)} for c in cache
            ],
        }
        # Rows have no byte offsets: cut by the column's average size per row.
        per_row = ds.data.nbytes / max(1, ds.num_rows)
        rows = max(1, int(target / max(per_row, 1e-9)))
        units = [
            {"rows": [a, b], "bytes": round(per_row * (b - a))}
            for a in range(0, ds.num_rows, rows)
            for b in [min(a + rows, ds.num_rows)]
        ]
        return source, [], units
    raise DataError(f"unknown --source {args.source!r}: use jsonl, text or hf_datasets")
