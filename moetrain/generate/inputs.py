"""The prompts `python -m moetrain.generate` is given (--prompt TEXT, --chat FILE or --prompts
FILE), read and checked before anything is loaded, and their token ids once the tokenizer
is (`prompt_ids`). Every refusal is a DataError naming the flag, the file (and line) and
the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moetrain.errors import DataError

MESSAGES = 'a JSON list of {"role": "user"|"assistant"|"system", "content": TEXT} objects'
PROMPT_LINE = (
    'one JSON object a line: {"messages": [...]} (rendered with the chat template) or '
    '{"prompt": TEXT}'
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: a user message (`text`; raw text when there is no chat template) or a
    conversation (`messages`), rendered with the generation prompt."""

    where: str  # how messages name it: "--prompt", "--chat FILE", "--prompts FILE:N"
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    line: int | None = None  # its line in a --prompts file


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """`messages` if it is a non-empty list of role/content objects; else DataError."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: holds a {type(messages).__name__}, not a list; give {MESSAGES}")
    if not messages:
        raise DataError(f"{where}: the list of messages is empty; give {MESSAGES}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"{where}: message {i} is not a role and a content; give {MESSAGES}")
    return messages


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise DataError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{flag} {path}: not UTF-8 text ({err}); save it as UTF-8") from None


def read_chat(path: str) -> Prompt:
    """The conversation of a --chat file."""
    where = f"--chat {path}"
    text = _read_text(path, "--chat")
    if not text.strip():
        raise DataError(f"{where}: the file is empty; give {MESSAGES}")
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err}); give {MESSAGES}") from None
    return Prompt(where, messages=check_messages(messages, where))


def _prompt_line(record: Any, where: str, line: int) -> Prompt:
    kind = type(record).__name__
    if not isinstance(record, dict):
        raise DataError(f"{where}: holds a {kind}, not an object; give {PROMPT_LINE}")
    unknown = sorted(set(record) - {"messages", "prompt"})
    if unknown:
        raise DataError(f"{where}: unknown keys {unknown}; give {PROMPT_LINE}")
    if len(record) != 1:
        which = "both" if record else "neither"
        raise DataError(f"{where}: holds {which} of messages and prompt; give {PROMPT_LINE}")
    if "messages" in record:
        return Prompt(where, messages=check_messages(record["messages"], where), line=line)
    text = record["prompt"]
    if not isinstance(text, str) or not text:
        raise DataError(
            f"{where}: prompt must be a non-empty string, not {text!r}; give {PROMPT_LINE}"
        )
    return Prompt(where, text=text, line=line)


def read_prompts(path: str) -> list[Prompt]:
    """The prompts of a --prompts JSONL file, one a line (blank lines hold none)."""
    prompts = []
    for line, text in enumerate(_read_text(path, "--prompts").splitlines(), start=1):
        if not text.strip():
            continue
        where = f"--prompts {path}:{line}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not JSON ({err}); give {PROMPT_LINE}") from None
        prompts.append(_prompt_line(record, where, line))
    if not prompts:
        raise DataError(f"--prompts {path}: the file holds no prompt; give {PROMPT_LINE}")
    return prompts


def prompt_ids(tokenizer: Any, prompt: Prompt, checkpoint: str) -> list[int]:
    """The prompt's ids: the messages rendered as prepare rendered the data (the text, then
    its tokens without added specials, as apply_chat_template tokenizes), or the raw text
    when the model has no chat template (a `text` prompt only)."""
    tok = tokenizer.tok
    if not tokenizer.has_template:
        if prompt.messages is not None:
            raise DataError(
                f"{prompt.where}: {checkpoint} has no chat template to render messages with "
                "(its data was not prepared with --format chat); give the prompt as text "
                '(--prompt TEXT, or {"prompt": TEXT} lines), which is then taken as raw text'
            )
        ids = [int(i) for i in tok.encode(prompt.text)]  # the byte tokenizer's, or HF's
    else:
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **tokenizer.template_kwargs
        )
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise DataError(f"{prompt.where}: the prompt has no tokens; give some text")
    return ids
