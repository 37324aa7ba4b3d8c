"""`--format chat|prompt_completion`: instruction data rendered to tokens and a loss mask.

- chat: a JSON line `{"messages": [{"role": ..., "content": ...}, ...]}` is rendered with the
  tokenizer's own chat template (the model directory's, or `--chat-template FILE`) by
  transformers' `apply_chat_template`, then tokenized as `apply_chat_template` tokenizes
  (the text, no special tokens added): the tokens the model was trained with. The loss mask
  covers each assistant turn as the full rendering of the conversation shows it:
  - a template with `{% generation %}` blocks marks them itself (transformers'
    `return_assistant_tokens_mask`);
  - otherwise each assistant turn is located in the full rendering (`_assistant_span`):
    from the end of its prompt (the conversation before it, rendered with the generation
    prompt) to the end of its content and the template's end-of-turn text, less trailing
    whitespace. A template that rewrites earlier turns (Qwen3 drops the think block of
    every assistant turn before the last user message) trains on what the full rendering
    shows of them. A conversation whose turns cannot be located is refused, naming the
    turn, the cause and the fix.
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
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.errors import DataError
from trainer.prepare.chat_template import check_syntax, read_template, rendering, template_origin
from trainer.prepare.chat_tokens import Tokens

FORMATS = ("text", "chat", "prompt_completion")

# A longer line (one conversation, or prompt/completion pair) is refused before it is read
# whole: a worker holds a few copies of one (the line, its text, the renderings) and its
# tokens (in pieces: chat_tokens.py), about 12 bytes per byte of the line measured
# (benchmarks/long_docs.py --chat), which this keeps, with the ~300 MiB of transformers,
# well within a worker's 1 GiB (docs/data.md), even at a token per byte of text.
MAX_LINE_BYTES = 32 << 20


def too_long(fmt: str, where: str) -> DataError:
    """The refusal of a `--format chat|prompt_completion` line over MAX_LINE_BYTES."""
    what = "conversation" if fmt == "chat" else "prompt/completion pair"
    return DataError(
        f"{where}: this {what} is longer than {MAX_LINE_BYTES / 2**20:g} MiB, the most one line "
        "of instruction data may hold (a prepare worker's memory stays within 1 GiB); at "
        "millions of tokens it is longer than any sample it could be packed into (instruction "
        "data is never cut, so it would be left out): split it into several lines (e.g. one "
        "per round of the conversation), or remove it"
    )


ROLES = ("system", "user", "assistant", "tool")


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


def check_messages(record: Any, where: Where) -> list[dict[str, str]]:
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


# Appended to one assistant turn's content to find where the template puts that content's
# end: text no template rewrites and no conversation holds (checked).
_MARK = "\u2063<moetrain:end-of-content>\u2063"


def has_generation_markers(template: str) -> bool:
    """Whether a chat template marks the assistant's text itself ({% generation %})."""
    return re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def render_chat(
    tok: Any, messages: list[dict[str, str]], where: Where, origin: str = "its template"
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation: int64 [T] and uint8 [T], EOS not included. What the
    template raises is refused naming `where` and the template (`origin`)."""
    with rendering(origin, where):
        return _render_chat(tok, messages, where)


def _render_chat(
    tok: Any, messages: list[dict[str, str]], where: Where
) -> tuple[np.ndarray, np.ndarray]:
    if has_generation_markers(tok.chat_template):
        from transformers.utils.chat_template_utils import render_jinja_template

        # What apply_chat_template(..., return_assistant_tokens_mask=True) renders, its
        # tokens and mask then taken in pieces (chat_tokens.py: not the whole at once).
        (full,), (spans,) = render_jinja_template(
            conversations=[messages],
            chat_template=tok.get_chat_template(),
            return_assistant_tokens_mask=True,
            **tok.special_tokens_map,
        )
        tokens = Tokens(tok, full, lambda: at(where))
        del full
        mask = tokens.generation_mask(spans)
        if not mask.any():
            raise _problem(
                where,
                "the chat template's {% generation %} blocks mark no token of this "
                "conversation; put each assistant turn's text (and its end-of-turn token) "
                "inside {% generation %} ... {% endgeneration %}",
            )
        return tokens.all_ids(), mask

    def text(msgs: list[dict[str, str]], prompt: bool = False) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    full = text(messages)
    if any(_MARK in m["content"] for m in messages):
        raise _problem(where, "a message holds the renderer's marker text; remove it")
    spans = [
        _assistant_span(text, messages, i, full, where)
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]
    tokens = Tokens(tok, full, lambda: at(where))  # tok(full)'s ids, in pieces (chat_tokens.py)
    return tokens.all_ids(), tokens.located_mask(spans)


_FIX = (
    "use --chat-template FILE with a template that renders every turn the same way whatever "
    "follows it, or one with {% generation %} blocks (or --format prompt_completion)"
)


def _assistant_span(
    text: Callable[..., str], messages: list[dict[str, str]], i: int, full: str, where: Where
) -> tuple[int, int]:
    """Character span [a, b) of assistant turn i in the full rendering `full`: from the end
    of its prompt to the end of its content plus the template's end-of-turn text."""
    turn = f"assistant turn {i} (message {i})"
    if i == 0:
        raise _problem(where, "the first message is an assistant turn: there is no prompt")
    prompt = text(messages[:i], True)  # [..., generation prompt]
    if not full.startswith(prompt):
        at = next(
            (k for k, (x, y) in enumerate(zip(prompt, full, strict=False)) if x != y),
            min(len(prompt), len(full)),
        )
        raise _problem(
            where,
            f"{turn}: the conversation before it, rendered with the generation prompt, is not "
            f"how the full rendering begins (they differ at character {at}: "
            f"{prompt[at : at + 30]!r} against {full[at : at + 30]!r}): the chat template "
            f"renders the earlier turns differently when this turn follows; {_FIX}",
        )
    marked = [*messages[:i], dict(messages[i], content=messages[i]["content"] + _MARK)]
    full_marked = text(marked + messages[i + 1 :])
    if full_marked.count(_MARK) != 1:
        raise _problem(
            where,
            f"{turn}: the chat template shows its content {full_marked.count(_MARK)} times in "
            f"the rendering, not once, so the turn cannot be located; {_FIX}",
        )
    after = full_marked[full_marked.index(_MARK) + len(_MARK) :]  # the rest, from its end
    end = len(full) - len(after)
    if not full.endswith(after) or end < len(prompt):
        raise _problem(
            where,
            f"{turn}: the chat template renders the rest of the conversation differently when "
            f"the turn's content changes, so its end cannot be located; {_FIX}",
        )
    # The end-of-turn text: what the template writes after the content when the turn is
    # the last one (e.g. <|im_end|>, <|eot_id|>), without the whitespace that follows it.
    last = text(marked)
    closing = last[last.index(_MARK) + len(_MARK) :].rstrip()
    if not full.startswith(closing, end):
        raise _problem(
            where,
            f"{turn}: its end-of-turn text {closing!r} does not follow its content in the full "
            f"rendering ({full[end : end + 30]!r}); {_FIX}",
        )
    return len(prompt), end + len(closing)


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


_TOKENIZERS: dict[tuple[str, str, str | None], Any] = {}  # per worker process: loaded once


def _tokenizer(job: dict) -> Any:
    key = (job["format"], job["tokenizer_arg"], job.get("chat_template"))
    if key not in _TOKENIZERS:
        if job["format"] == "chat":
            _TOKENIZERS[key] = chat_tokenizer(job["tokenizer_arg"], job.get("chat_template"))
        else:
            from tokenizers import Tokenizer

            _TOKENIZERS[key] = Tokenizer.from_file(job["tokenizer_path"])
    return _TOKENIZERS[key]


def document(job: dict, line: str, where: Callable[[], str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one non-blank JSON line, EOS not included: int64 [T], uint8 [T]."""
    record = parse(line, where)
    if job["format"] == "chat":
        origin = template_origin(job["tokenizer_arg"], job.get("chat_template"))
        return render_chat(_tokenizer(job), check_messages(record, where), where, origin)
    prompt, completion = check_prompt_completion(record, where)
    if job["tokenizer_path"] is None:  # the byte tokenizer: ids are the UTF-8 bytes
        p, c = (np.frombuffer(t.encode("utf-8"), np.uint8) for t in (prompt, completion))
    else:  # as HFTokenizer.encode (no special tokens), in pieces as a chat (chat_tokens.py)
        tok = _tokenizer(job)
        p, c = (Tokens(tok, t, lambda: at(where)).all_ids() for t in (prompt, completion))
    mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)])
    return np.concatenate([p, c]).astype(np.int64), mask


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
