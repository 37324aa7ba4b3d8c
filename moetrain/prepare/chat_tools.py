"""Tool-call arguments in the form each chat template takes (`prepare --tool-arguments`).

Templates disagree on what a call's `arguments` is. transformers' convention is a mapping,
which Llama-3, Mistral-Nemo, GLM-4.5 and GPT-OSS write with `tojson` (or walk as a mapping);
DeepSeek-V3.1 concatenates it as text, so a mapping fails there; Qwen3 takes either. Data
comes both ways (OpenAI's API writes JSON text). The wrong form is either refused by the
template or, worse, rendered silently wrong: a JSON text through `tojson` is encoded twice
(`"{\\"a\\": 2}"`), a mapping written as text is a Python repr (`{'a': 2}`).

`auto` renders one probe call both ways and picks the form the template writes right:
- `string` when the mapping fails or shows as a Python repr;
- `object` when the text fails, is encoded twice, or is not written;
- `as_given` when both are written alike (Qwen3), or neither is (a template without tool
  calls, Mixtral's: the trained-text check then refuses conversations that have calls).
Each conversation's calls are then converted to that form (`convert`); a text that is not a
JSON object cannot become a mapping and is refused by its line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from moetrain.errors import DataError
from moetrain.prepare.chat_messages import Conversation

TOOL_ARGUMENTS = ("auto", "object", "string")
AS_GIVEN = "as_given"  # what auto resolves to when either form renders the same

_VALUE = "moetrain-probe-value"
_ARGUMENTS = {"probe_key": _VALUE}
_JSON = json.dumps(_ARGUMENTS)
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}},
        },
    }
]


def _probe(arguments: Any) -> list[dict[str, Any]]:
    # A 9-character id: Mistral-Nemo refuses any other length.
    call = {
        "id": "probe0001",
        "type": "function",
        "function": {"name": "probe_tool", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def _rendered(render: Callable[[list, list], str], arguments: Any) -> str | None:
    try:
        return render(_probe(arguments), _TOOLS)
    except Exception:  # noqa: BLE001 (any failure means: not this form)
        return None


def resolve(render: Callable[[list, list], str], option: str) -> str:
    """The form conversations' tool-call arguments are rendered in: `object`, `string` or
    `as_given`; `render(messages, tools)` is the template's rendering."""
    if option != "auto":
        return option
    as_object, as_string = _rendered(render, _ARGUMENTS), _rendered(render, _JSON)
    if as_object is not None and as_string is not None and _VALUE not in as_object + as_string:
        return AS_GIVEN  # the template writes no tool call: nothing to convert
    object_wrong = as_object is None or _VALUE not in as_object or repr(_ARGUMENTS) in as_object
    string_wrong = as_string is None or _VALUE not in as_string
    string_wrong = string_wrong or json.dumps(_JSON)[1:-1] in as_string  # encoded twice
    if object_wrong and not string_wrong:
        return "string"
    if string_wrong and not object_wrong:
        return "object"
    return AS_GIVEN


def _converted(arguments: Any, to: str, where: Callable[[], str]) -> Any:
    if to == "string":
        return (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{where()} are the text {arguments[:60]!r}, which is not JSON ({err.msg}), and the "
            "chat template renders arguments as an object; write them as a JSON object"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"{where()} are the JSON {type(value).__name__} {arguments[:60]!r}, and the chat "
            "template renders arguments as an object; write them as a JSON object"
        )
    return value


def convert(conv: Conversation, to: str, where: str | Callable[[], str]) -> Conversation:
    """`conv` with every tool call's arguments in the form `to` (`object` or `string`; the
    conversation itself for `as_given`), the records left as they are."""
    if to == AS_GIVEN or not any(m.get("tool_calls") for m in conv.messages):
        return conv
    messages = []
    for i, m in enumerate(conv.messages):
        calls = m.get("tool_calls")
        if not calls:
            messages.append(m)
            continue
        new_calls = []
        for j, call in enumerate(calls):
            inner = call.get("function") if isinstance(call, dict) else None
            nested = isinstance(inner, dict)  # transformers' {"function": {name, arguments}}
            holder = inner if nested else call
            if not isinstance(holder, dict) or "arguments" not in holder:
                new_calls.append(call)
                continue

            def at(i: int = i, j: int = j) -> str:
                line = where() if callable(where) else where
                return f"{line}: message {i}, tool call {j}: its arguments"

            holder = dict(holder, arguments=_converted(holder["arguments"], to, at))
            new_calls.append(dict(call, function=holder) if nested else holder)
        messages.append(dict(m, tool_calls=new_calls))
    return Conversation(messages, conv.tools)
