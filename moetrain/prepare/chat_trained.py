"""What each assistant answer trains, checked against the answer (`prepare --format chat`).

The spans come from renderings (chat_turns.py), so they are right for any template that
writes the answers; a template that does not (one that drops assistant content, writes the
header and the end-of-turn text alone, or ignores tool calls) would leave each answer
training its stop text and nothing of what it says, silently. Every answer is checked in
the text its document trains for it:
- its content, as templates write it: the text after a think block (`</think>`), whose
  reasoning a template may move or drop (Qwen3 keeps only the last round's, and renders a
  `reasoning_content` field as a think block), less surrounding whitespace (Llama-3 trims);
- the name of each tool call it makes;
- for a template that ends turns with text, at least that: an answer with nothing trained
  would teach nothing, not even to stop (a template without end-of-turn text trains the
  next turn's first token instead, added after this check).
A failure is refused by the conversation's input line, naming the turn and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetrain.errors import DataError

_FIX = (
    "render with a template that writes every assistant message (the model's own, or "
    "--chat-template FILE)"
)


def written_content(message: dict[str, Any]) -> str:
    """The part of an answer's content every template writes, less whitespace."""
    content = message.get("content")
    if not isinstance(content, str):
        return ""
    return content.split("</think>")[-1].strip()


def call_names(message: dict[str, Any]) -> list[str]:
    """The names of the tool calls of an answer, in the transformers form or a flat one."""
    names = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            holder = call.get("function") if isinstance(call.get("function"), dict) else call
            if isinstance(holder.get("name"), str) and holder["name"]:
                names.append(holder["name"])
    return names


def check_answer(
    message: dict[str, Any],
    turn: int,
    text: str,
    trained: str,
    closes: bool,
    origin: str,
    where: str | Callable[[], str],
) -> None:
    """Refuse answer `turn` (`message`) when `trained`, the text of `text` (its document)
    that trains it, lacks its content, a tool call, or (`closes`: a template that ends
    turns with text) anything at all."""
    at = f"{where() if callable(where) else where}: assistant turn {turn} (message {turn})"
    shown = f"the text trained for it is {trained[:80]!r}"
    content = written_content(message)
    if content and content not in trained:
        place = "writes it elsewhere in the conversation" if content in text else "never writes it"
        raise DataError(
            f"{at}: the chat template ({origin}) {place}, not in the answer ({shown}): its "
            f"content {content[:60]!r} would not be trained; {_FIX}"
        )
    for name in call_names(message):
        if name not in trained:
            raise DataError(
                f"{at}: the chat template ({origin}) does not write its tool call {name!r} in "
                f"the answer ({shown}): the call would not be trained; remove the tool calls "
                "from such conversations, or render with a template that writes them "
                "(--chat-template FILE)"
            )
    if closes and not trained:
        raise DataError(
            f"{at}: no text of it is trained: the chat template ({origin}) writes nothing for "
            f"it, not even an end-of-turn text; remove that turn, or {_FIX}"
        )
