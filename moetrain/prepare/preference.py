"""`prepare --format preference`: a preference pair (TRL's conversational layout) to the two
documents that train it, the chosen side then the rejected side, adjacent in one shard.

A record (a JSON line or a dataset row) is one of:
- `{"prompt": [messages], "chosen": [assistant message], "rejected": [assistant message]}`
  (explicit prompt), with an optional `tools` list;
- `{"chosen": [messages], "rejected": [messages]}` (implicit prompt): two whole
  conversations whose shared leading messages are the prompt, split off here.

Each side is the prompt followed by its answer, rendered as `--format chat` renders a
conversation's last answer (`chat_turns`, `last`): the answer after its generation prompt,
with its stop target trained, its text checked. The pair's identity is its place: document
2k is pair k's chosen side, 2k + 1 its rejected side (a unit writes whole records, so a pair
never spans two shards). Refused by file:line: a side that is empty or not one assistant
answer, sides that answer different prompts, a prompt that ends with an assistant turn, and
sides whose prompts the template renders to different tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from moetrain.errors import DataError
from moetrain.prepare.chat_messages import Conversation, conversation_of
from moetrain.prepare.truncate import Cuts, Rendered

SIDES = ("chosen", "rejected")
Where = str | Callable[[], str]
LAYOUT = (
    "TRL's conversational preference layout: {prompt: [messages], chosen: [assistant "
    "message], rejected: [assistant message]}, or {chosen: [messages], rejected: [messages]} "
    "sharing their leading messages"
)


def _where(where: Where) -> str:
    return where() if callable(where) else where


def _problem(where: Where, what: str) -> DataError:
    return DataError(f"{_where(where)}: {what}")


def _messages(record: dict, key: str, where: Where) -> list:
    value = record.get(key)
    if isinstance(value, str):
        raise _problem(
            where,
            f"{key!r} is text, not a list of messages: --format preference reads {LAYOUT}",
        )
    if not isinstance(value, list):
        found = ", ".join(map(repr, list(record)[:10])) or "none"
        raise _problem(
            where, f"no {key!r} list of messages (its fields: {found}); expected {LAYOUT}"
        )
    return value


def _split_shared_prompt(chosen: list, rejected: list, where: Where) -> tuple[list, list, list]:
    """(prompt, chosen answer, rejected answer) of two whole conversations: the messages
    both begin with are the prompt."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise _problem(
            where,
            "the chosen and rejected conversations differ from their first message: they "
            "answer different prompts, and both sides must answer the same prompt (give it "
            "as 'prompt', or make the leading messages equal)",
        )
    if shared == len(chosen) or shared == len(rejected):
        side = "chosen" if shared == len(chosen) else "rejected"
        raise _problem(
            where,
            f"the {side} side holds nothing after the messages both sides share: an empty "
            "answer; give each side its own answer",
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def pair_messages(record: Any, where: Where) -> tuple[Conversation, Conversation]:
    """The chosen and rejected conversations (the prompt, then that side's one answer) of a
    record, checked (see the module)."""
    if not isinstance(record, dict):
        raise _problem(where, f"a JSON {type(record).__name__}, not an object; expected {LAYOUT}")
    chosen, rejected = (_messages(record, key, where) for key in SIDES)
    if "prompt" in record:
        prompt = _messages(record, "prompt", where)
    else:
        prompt, chosen, rejected = _split_shared_prompt(chosen, rejected, where)
    if not prompt:
        raise _problem(where, "the prompt has no message: there is nothing the answers answer")
    tools = {"tools": record["tools"]} if record.get("tools") is not None else {}
    sides = []
    for key, answer in zip(SIDES, (chosen, rejected), strict=True):
        if not answer:
            raise _problem(where, f"the {key} side is empty; give it its answer")
        roles = [m.get("role") if isinstance(m, dict) else None for m in answer]
        if roles != ["assistant"]:
            raise _problem(
                where,
                f"the {key} side holds the roles {roles} after the prompt, not one assistant "
                "answer: both sides must answer the same prompt (put the shared turns in "
                "'prompt', or make them equal in both sides)",
            )
        message = answer[0]
        if not message.get("tool_calls") and not str(message.get("content") or "").strip():
            raise _problem(where, f"the {key} side's answer is empty; give it its text")
        sides.append(conversation_of({"messages": [*prompt, message], **tools}, where))
    if sides[0].messages[len(prompt) - 1]["role"] == "assistant":
        raise _problem(
            where,
            "the prompt ends with an assistant turn: the answers would follow an answer, not a "
            "question; end the prompt with the turn they answer (user or tool)",
        )
    return sides[0], sides[1]


def check_same_prompt(docs: list[Rendered], where: Where) -> None:
    """Both sides must train their answers after the same prompt tokens."""
    (chosen, chosen_mask, *_), (rejected, rejected_mask, *_) = docs
    a, b = int(np.argmax(chosen_mask)), int(np.argmax(rejected_mask))
    if a != b or not np.array_equal(chosen[:a], rejected[:b]):
        raise _problem(
            where,
            f"the chat template writes the prompt differently before the two answers (the "
            f"chosen side's answer starts at token {a}, the rejected side's at {b}): the two "
            "log-probabilities would not compare answers to one prompt; use --chat-template "
            "FILE with a template that renders the prompt alike",
        )


def fit_pair(
    docs: list[Rendered], seq_len: int | None, cuts: Cuts
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The pair's two documents as the shard writes them, or none when `seq_len` (--truncate)
    is given and the pair does not fit one sample of it (both sides, each with its EOS, in
    seq_len + 1 tokens). A side's one trained answer is its last turn, so the SFT rule (cut
    after the last whole answer that fits) has no cut that keeps it: the pair is left out
    and counted."""
    if seq_len is not None and sum(len(ids) + 1 for ids, *_ in docs) > seq_len + 1:
        cuts.dropped += 1
        return []
    return [(ids, mask, eos) for ids, mask, eos, _ in docs]
