"""`--format chat|prompt_completion|preference`: instruction data rendered to tokens and a
loss mask.

- chat: a record (a JSON line or a dataset row; `chat_messages.py`: `messages` or ShareGPT's
  `conversations`, tool calls and a `tools` list) is rendered with the tokenizer's own chat
  template (the model directory's, or `--chat-template FILE`, with the options of
  `--chat-template-kwargs`) by transformers' `apply_chat_template`, then tokenized as
  `apply_chat_template` tokenizes (the text, no special tokens added): the tokens the model
  was trained with. Which renderings train which answers (`--chat-turns`), and their stop
  targets: `chat_turns.py`; tool-call arguments in the template's form (`--tool-arguments`):
  `chat_tools.py`; each answer's trained text checked: `chat_trained.py`.
- prompt_completion: `{"prompt": ..., "completion": ...}` tokenized separately (so the
  boundary never merges) and concatenated; the loss covers the completion and the EOS.
- preference: a pair (TRL's conversational layout) as two adjacent documents, chosen then
  rejected, each rendered as chat renders a conversation's last answer (`preference.py`).

Every document ends with EOS, a target after a completion, and after a conversation's last
answer when its template writes no end-of-turn text. Bad lines are refused by file:line with
the fix.

NOTE: chat rendering needs transformers, which imports torch: a worker that renders chats
pays about 2 s and 300 MB once; the other formats stay torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from moetrain.errors import DataError
from moetrain.prepare import chat_turns, preference
from moetrain.prepare.chat_messages import conversation_of
from moetrain.prepare.chat_template import check_syntax, read_template, rendering, template_origin
from moetrain.prepare.chat_tokens import Tokens
from moetrain.prepare.truncate import Rendered

FORMATS = ("text", "chat", "prompt_completion", "preference")
# The formats rendered with a chat template (`preference`: each side as chat's last answer).
RENDERED = ("chat", "preference")

# A longer line (one conversation, or prompt/completion pair) is refused before it is read
# whole: a worker holds a few copies of one (the line, its text, the renderings) and its
# tokens (in pieces: chat_tokens.py), about 12 bytes per byte of the line measured
# (benchmarks/long_docs.py --chat), which this keeps, with the ~300 MiB of transformers,
# well within a worker's 1 GiB (docs/data.md), even at a token per byte of text.
MAX_LINE_BYTES = 32 << 20


def too_long(fmt: str, where: str) -> DataError:
    """The refusal of a `--format chat|prompt_completion` line over MAX_LINE_BYTES."""
    what = {"chat": "conversation", "preference": "preference pair"}.get(
        fmt, "prompt/completion pair"
    )
    return DataError(
        f"{where}: this {what} is longer than {MAX_LINE_BYTES / 2**20:g} MiB, the most one line "
        "of instruction data may hold (a prepare worker's memory stays within 1 GiB); at "
        "millions of tokens it is longer than any sample it could be packed into (instruction "
        "data is never cut, so it would be left out): split it into several lines (e.g. one "
        "per round of the conversation), or remove it"
    )


def chat_tokenizer(path: str, template_file: str | None = None) -> Any:
    """transformers' tokenizer of a model directory (or a tokenizer.json's directory), with
    its chat template, or the Jinja template in `template_file` instead (`--chat-template`);
    DataError naming the fix when there is none."""
    # NOTE: only what the user named is read: "byte" (or a path that is not there) taken as
    # a file would make its directory the working directory, and transformers would load
    # whatever tokenizer happens to lie there.
    if path == "byte":
        raise DataError(
            "--format chat renders each conversation with a Hugging Face tokenizer's chat "
            "template, and --tokenizer byte (the default) has no template and no special "
            "tokens for turns, nor is there a built-in one: pass --tokenizer MODEL_DIR (the "
            "model's directory, with tokenizer.json and tokenizer_config.json; --chat-template "
            "FILE to render with another template), or use --format prompt_completion, which "
            "works with --tokenizer byte"
        )
    if not os.path.exists(path):
        raise DataError(
            f"--tokenizer {path!r} does not exist: --format chat needs the model's directory "
            "(tokenizer.json and tokenizer_config.json, with its chat template)"
        )
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # many kinds, one meaning for the user
        raise DataError(
            f"--tokenizer {path!r}: transformers cannot load a tokenizer from {directory} "
            f"({type(err).__name__}: {err}); --format chat needs the model's directory "
            "(tokenizer.json and tokenizer_config.json)"
        ) from None
    if template_file is not None:
        tok.chat_template = read_template(template_file)
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"the tokenizer in {directory} has no chat template (no chat_template in its "
            "tokenizer_config.json or chat_template.jinja): --format chat renders "
            "conversations with it; use the model's own directory, or --format "
            "prompt_completion"
        )
    check_syntax(tok, template_origin(path, template_file))
    return tok


# Where a line is (file:line), or how to find out: counting a line's number reads its unit
# up to it, so a worker asks only when it refuses the line.
Where = str | Callable[[], str]


def at(where: Where) -> str:
    return where() if callable(where) else where


def _problem(where: Where, what: str) -> DataError:
    return DataError(f"{at(where)}: {what}")


def render_chat(
    tok: Any, messages: list[dict[str, Any]], where: Where, origin: str = "its template"
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation in one document (`--chat-turns full`), EOS not
    included. What the template raises is refused naming `where` and the template."""
    with rendering(origin, where):
        return chat_turns.render_chat(tok, messages, where)


def check_prompt_completion(record: Any, where: Where) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise _problem(where, f"a JSON {type(record).__name__}, not an object")
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        raise _problem(
            where, f"no {' and '.join(map(repr, missing))} field (the line has {list(record)[:10]})"
        )
    for key in ("prompt", "completion"):
        if not isinstance(record[key], str):
            raise _problem(where, f"field {key!r} is {type(record[key]).__name__}, not text")
    return record["prompt"], record["completion"]


_TOKENIZERS: dict[tuple[str, ...], Any] = {}  # per worker process: loaded once


def _tokenizer(job: dict) -> Any:
    """The job's tokenizer (for --format chat: a `chat_turns.Renderer` of its template)."""
    options = json.dumps(job.get("chat_template_kwargs") or {}, sort_keys=True)
    arguments = job.get("tool_arguments", "auto")
    key = (job["format"], job["tokenizer_arg"], str(job.get("chat_template")), options, arguments)
    if key not in _TOKENIZERS:
        if job["format"] in RENDERED:
            tok = chat_tokenizer(job["tokenizer_arg"], job.get("chat_template"))
            origin = template_origin(job["tokenizer_arg"], job.get("chat_template"))
            _TOKENIZERS[key] = chat_turns.Renderer(
                tok, job.get("chat_template_kwargs"), arguments, origin
            )
        else:
            from tokenizers import Tokenizer

            _TOKENIZERS[key] = Tokenizer.from_file(job["tokenizer_path"])
    return _TOKENIZERS[key]


# (ids int64, mask uint8, EOS a target, where its trained answers end: truncate.py)
Documents = list[Rendered]


def documents(job: dict, record: Any, where: Where) -> tuple[Documents, str | None]:
    """The documents of one record (a parsed JSON line or a dataset row), EOS not included,
    and for a conversation the `--chat-turns` mode that rendered it."""
    if job["format"] == "preference":
        return _pair_documents(job, record, where), None
    if job["format"] == "chat":
        conversation = conversation_of(record, where)
        origin = template_origin(job["tokenizer_arg"], job.get("chat_template"))
        with rendering(origin, where):
            docs, mode = chat_turns.render_conversation(
                _tokenizer(job), conversation, job.get("chat_turns", "auto"), where
            )
        return [(d.ids, d.mask, int(d.eos_target), d.answer_ends) for d in docs], mode
    prompt, completion = check_prompt_completion(record, where)
    if job["tokenizer_path"] is None:  # the byte tokenizer: ids are the UTF-8 bytes
        p, c = (np.frombuffer(t.encode("utf-8"), np.uint8) for t in (prompt, completion))
    else:  # as HFTokenizer.encode (no special tokens), in pieces as a chat (chat_tokens.py)
        tok = _tokenizer(job)
        p, c = (Tokens(tok, t, lambda: at(where)).all_ids() for t in (prompt, completion))
    mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)])
    ids = np.concatenate([p, c]).astype(np.int64)
    return [(ids, mask, 1, (len(ids),))], None  # the EOS: a target, the completion's end


def _pair_documents(job: dict, record: Any, where: Where) -> Documents:
    """A preference pair's two documents, chosen then rejected (`preference.py`): each side
    rendered as `--chat-turns last` renders a conversation's last answer."""
    sides = preference.pair_messages(record, where)
    origin = template_origin(job["tokenizer_arg"], job.get("chat_template"))
    docs = []
    with rendering(origin, where):
        for side in sides:
            (doc,), _ = chat_turns.render_conversation(_tokenizer(job), side, "last", where)
            docs.append((doc.ids, doc.mask, int(doc.eos_target), doc.answer_ends))
    preference.check_same_prompt(docs, where)
    return docs


def parse(line: str, where: Callable[[], str]) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise _problem(
            where(), f"not valid JSON ({err.msg} at column {err.colno}); fix or delete that line"
        ) from None
