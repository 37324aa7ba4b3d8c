"""`--format chat|prompt_completion`: instruction data rendered to tokens and a loss mask.

- chat: a JSON line `{"messages": [{"role": ..., "content": ...}, ...]}` is rendered with the
  tokenizer's own chat template by transformers' `apply_chat_template` (the model
  directory's `tokenizer_config.json`), then tokenized as `apply_chat_template` tokenizes
  (the text, no special tokens added): the tokens the model was trained with. The loss mask
  covers each assistant turn and its end-of-turn token: the text the template adds for that
  turn (between the prompt rendered with `add_generation_prompt=True` and the conversation
  rendered up to that turn), less trailing whitespace. A template that does not render a
  conversation prefix by prefix is refused.
- prompt_completion: `{"prompt": ..., "completion": ...}` tokenized separately (so the
  boundary never merges) and concatenated; the loss covers the completion and the EOS.

Every document ends with EOS (outside the loss for chat: the template's end-of-turn token
ends the last turn). Bad lines are refused by file:line with the fix.

NOTE: chat rendering needs transformers, which imports torch: a worker that renders chats
pays about 2 s and 300 MB once; the other formats stay torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.errors import DataError

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")


def chat_tokenizer(path: str) -> Any:
    """transformers' tokenizer of a model directory (or a tokenizer.json's directory), with
    its chat template; DataError naming the fix when it has none."""
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
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"the tokenizer in {directory} has no chat template (no chat_template in its "
            "tokenizer_config.json or chat_template.jinja): --format chat renders "
            "conversations with it; use the model's own directory, or --format "
            "prompt_completion"
        )
    return tok


def _problem(where: str, what: str) -> DataError:
    return DataError(f"{where}: {what}")


def check_messages(record: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(record, dict) or "messages" not in record:
        has = list(record)[:10] if isinstance(record, dict) else type(record).__name__
        raise _problem(where, f"no 'messages' field (the line has {has}); --format chat reads "
                       "lines like {\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}")  # fmt: skip
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _problem(where, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _problem(where, f"message {i} is not an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise _problem(
                where,
                f"message {i} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}",
            )
        if not isinstance(m["content"], str):
            raise _problem(
                where, f"message {i}'s content is {type(m['content']).__name__}, not text"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise _problem(
            where, "no assistant turn: nothing to train on (the loss covers assistant turns)"
        )
    return messages


def render_chat(
    tok: Any, messages: list[dict[str, str]], where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation: int64 [T] and uint8 [T], EOS not included."""

    def text(upto: int, prompt: bool) -> str:
        return tok.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=prompt
        )

    full = text(len(messages), False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise _problem(where, "the first message is an assistant turn: there is no prompt")
        prompt, upto = text(i, True), text(i + 1, False)
        if not (full.startswith(upto) and upto.startswith(prompt)):
            raise _problem(
                where,
                "the chat template does not render this conversation prefix by prefix, so the "
                "assistant turns cannot be found in it; use a template that does (or "
                "--format prompt_completion)",
            )
        spans.append((len(prompt), len(upto.rstrip())))
    encoded = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


def check_prompt_completion(record: Any, where: str) -> tuple[str, str]:
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


_TOKENIZERS: dict[tuple[str, str], Any] = {}  # per worker process: loaded once


def _tokenizer(job: dict) -> Any:
    key = (job["format"], job["tokenizer_arg"])
    if key not in _TOKENIZERS:
        if job["format"] == "chat":
            _TOKENIZERS[key] = chat_tokenizer(job["tokenizer_arg"])
        else:
            from tokenizers import Tokenizer

            _TOKENIZERS[key] = Tokenizer.from_file(job["tokenizer_path"])
    return _TOKENIZERS[key]


def _encode(tok: Any, text: str) -> list[int]:
    """Token ids of plain text, as HFTokenizer.encode (no special tokens)."""
    return tok.encode(text, add_special_tokens=False).ids


def document(job: dict, line: str, where: Callable[[], str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one non-blank JSON line, EOS not included: int64 [T], uint8 [T]."""
    record = parse(line, where)
    if job["format"] == "chat":
        return render_chat(_tokenizer(job), check_messages(record, where()), where())
    prompt, completion = check_prompt_completion(record, where())
    if job["tokenizer_path"] is None:  # the byte tokenizer: ids are the UTF-8 bytes
        p, c = list(prompt.encode("utf-8")), list(completion.encode("utf-8"))
    else:
        tok = _tokenizer(job)
        p, c = _encode(tok, prompt), _encode(tok, completion)
    mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)])
    return np.asarray(p + c, dtype=np.int64), mask


def eos_in_loss(fmt: str) -> int:
    """Whether the EOS after a document is a target: a completion's, yes; a chat's end-of-turn
    token is already its last assistant token."""
    return int(fmt == "prompt_completion")


def parse(line: str, where: Callable[[], str]) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise _problem(
            where(), f"not valid JSON ({err.msg} at column {err.colno}); fix or delete that line"
        ) from None
