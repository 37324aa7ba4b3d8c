"""What one line (or dataset row) of chat data holds, in the form chat templates take: the
messages, and the tools the conversation may call.

Layouts read (anything else is refused, naming the fields found and the ones expected):
- `{"messages": [{"role", "content"}, ...], "tools": [...]?}`: OpenAI's and transformers'
  form. An assistant turn may carry `tool_calls` with its `content` null, empty or absent;
  a `tool` message answers a call. Other fields of a message (`tool_call_id`, `name`,
  `reasoning_content`, ...) go to the template as they are.
- ShareGPT: `{"conversations": [{"from", "value"}, ...], "tools"?: ...}`, the roles
  `human`, `gpt`, `system` and `tool` (or the plain role names).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetrain.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
SHAREGPT_ROLES.update({r: r for r in ROLES})
LAYOUTS = (
    '"messages" (a list of {"role", "content"}), or ShareGPT\'s "conversations" (a list of '
    '{"from", "value"}); each with an optional "tools" list'
)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = field(default=None)


def _where(where: str | Callable[[], str]) -> str:
    return where() if callable(where) else where


def _problem(where: str | Callable[[], str], what: str) -> DataError:
    return DataError(f"{_where(where)}: {what}")


def _sharegpt(turns: Any, where: str | Callable[[], str]) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        raise _problem(where, "'conversations' must be a non-empty list of {from, value} objects")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise _problem(where, f"conversations[{i}] is not an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise _problem(
                where,
                f"conversations[{i}] is from {turn['from']!r}; ShareGPT's roles read here are "
                f"{', '.join(SHAREGPT_ROLES)}",
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def conversation_of(record: Any, where: str | Callable[[], str]) -> Conversation:
    """The conversation of one record (a parsed JSON line or a dataset row), checked."""
    if not isinstance(record, dict):
        raise _problem(where, f"a JSON {type(record).__name__}, not an object; expected {LAYOUTS}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise _problem(where, "'messages' must be a non-empty list of {role, content} objects")
    elif "conversations" in record:
        messages = _sharegpt(record["conversations"], where)
    else:
        found = ", ".join(map(repr, list(record)[:10])) or "none"
        raise _problem(
            where, f"no conversation in this record (its fields: {found}); expected {LAYOUTS}"
        )
    tools = record.get("tools")
    if isinstance(tools, str):  # datasets often keep the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise _problem(where, "'tools' is a string that is not a JSON list") from None
    if tools is not None and not isinstance(tools, list):
        raise _problem(where, f"'tools' must be a list of tool schemas, not {type(tools).__name__}")
    for i, m in enumerate(messages):
        _check_message(i, m, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise _problem(
            where, "no assistant turn: nothing to train on (the loss covers assistant turns)"
        )
    return Conversation(messages, tools or None)


def _check_message(i: int, m: Any, where: str | Callable[[], str]) -> None:
    if not isinstance(m, dict) or "role" not in m:
        raise _problem(where, f"message {i} is not an object with 'role' and 'content'")
    if m["role"] not in ROLES:
        raise _problem(
            where, f"message {i} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}"
        )
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
        raise _problem(where, f"message {i}: 'tool_calls' must be a list, on an assistant turn")
    content = m.get("content")
    if calls:  # a call's text is often null or empty: the template renders the call
        if content is not None and not isinstance(content, str):
            raise _problem(where, f"message {i}'s content is {type(content).__name__}, not text")
        return
    if "content" not in m:
        raise _problem(where, f"message {i} is not an object with 'role' and 'content'")
    if not isinstance(content, str):
        raise _problem(where, f"message {i}'s content is {type(content).__name__}, not text")
