"""A conversation to the documents that train it (`prepare --format chat --chat-turns`).

Invariant: every assistant answer is trained in a rendering that ends with it, or in one
that holds it exactly so (the same characters as the rendering cut after it), together with
its stop target: the end-of-turn text the template writes after it (`<|im_end|>`,
`<|eot_id|>`, `<|return|>`, DeepSeek's and Mixtral's EOS), or, for a template that writes
none (GLM-4.5), the token that begins the next turn, on which generation stops, and the EOS
after the last answer.

Answer i's span is found by rendering, never by searching the text: `prompt_i` is the
conversation before it with the generation prompt, `cut_i` the conversation cut after it;
the answer is `cut_i[len(prompt_i):]` less trailing whitespace. Where `prompt_i` does not
begin `cut_i` (the template writes the prompt otherwise once the answer follows:
Mistral-Nemo puts the system prompt into the last user turn only), the answer is trained
after `prompt_i`, the text the model generates it from, as `cut_i` writes it (`_splice`: a
document of `prompt_i` and the answer, `spliced`), provided `cut_i` writes the generation
prompt's own text right before it. Where the answer begins in `cut_i` is shown by a mark
put before its content, or, for a tool call the template writes without its content
(Mistral-Nemo's), by a plain answer of the mark standing in for it, whose rendering must
then begin `cut_i`. Else it is refused, saying why and what to change (DeepSeek-V3.1 with
`thinking`: its prompt opens `<think>`, its renderings of answers `</think>`).

Before any of that, tool calls' arguments are put in the form the template renders
(`chat_tools.py`, `--tool-arguments`); after it, each answer's trained text is checked to
hold what the answer says (`chat_trained.py`): a template that does not write the answers
is refused, not trained on their end-of-turn text alone.

- `full`: one document, the whole rendering. Where it holds every `cut_i` as its prefix,
  the spans are those; otherwise each answer is located as the full rendering shows it
  (`_located`: a marker appended to its content), e.g. Qwen3's answers without their think
  blocks once a later question follows.
- `per_turn`: one document per answer, `cut_i`, its last answer alone trained: each answer
  as the model generates it, at the cost of repeating the prompt (GPT-OSS ends its last
  answer with `<|return|>` and earlier ones with `<|end|>`; Mistral-Nemo puts the system
  prompt in the last user turn only; Qwen3 keeps the last answer's think block).
- `last`: the last answer alone, in the rendering cut after it.
- `auto`: `full` where the full rendering holds every `cut_i`, else `per_turn`.

A template with `{% generation %}` blocks marks the answers itself; the spans it marks are
kept (in `per_turn` and `last`, those of the last answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrain.errors import DataError
from moetrain.prepare import chat_tools
from moetrain.prepare.chat_messages import Conversation
from moetrain.prepare.chat_template import TemplateFailed
from moetrain.prepare.chat_tokens import Tokens
from moetrain.prepare.chat_trained import check_answer

TURNS = ("auto", "full", "per_turn", "last")
Where = str | Callable[[], str]

# Appended to one assistant turn's content to find where the template puts that content's
# end in `full` mode when no cut is a prefix: text no template rewrites (checked).
_MARK = "\u2063<moetrain:end-of-content>\u2063"
_FIX = "use --chat-turns per_turn, or --chat-template FILE with a template that renders every turn alike"


@dataclass
class ChatDocument:
    ids: np.ndarray  # int64 [T]: apply_chat_template(messages[:rendered], ...)'s ids
    mask: np.ndarray  # uint8 [T]: the trained tokens
    eos_target: bool  # the EOS the shard writes after it is its last answer's stop target
    rendered: int  # how many of the conversation's messages it renders
    spliced: bool = False  # the prompt then the answer, not a rendering of the messages
    # Where each trained answer ends, its stop target included (token indices, ascending):
    # the places `prepare --truncate` may end the document without cutting an answer.
    answer_ends: tuple[int, ...] = ()


def _where(where: Where) -> str:
    return where() if callable(where) else where


class Renderer:
    """One tokenizer's template, with its options (`--chat-template-kwargs`) and the form
    of tool-call arguments it renders (`--tool-arguments`, resolved: chat_tools.py)."""

    def __init__(
        self,
        tok: Any,
        kwargs: dict[str, Any] | None = None,
        tool_arguments: str = "auto",
        origin: str = "its template",
    ) -> None:
        self.tok, self.kwargs, self.origin = tok, dict(kwargs or {}), origin
        self.generation = _has_generation(str(tok.chat_template))
        self.closes = self._writes_end_of_turn()
        self.tool_arguments = chat_tools.resolve(
            lambda messages, tools: self._apply(messages, tools, False), tool_arguments
        )

    def text(self, conv: Conversation, upto: int, prompt: bool = False) -> str:
        messages = conv.messages[:upto]
        try:
            return self._apply(messages, conv.tools, prompt)
        except Exception:
            # A template that cannot take a call's null content (Qwen3's) gets "": the form
            # its own examples write, rendered the same.
            if not any(m.get("content", "") is None for m in messages):
                raise
            blank = [dict(m, content="") if m.get("content", "") is None else m for m in messages]
            return self._apply(blank, conv.tools, prompt)

    def _apply(self, messages: list, tools: list | None, prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=prompt, **self.kwargs
            )
        except Exception as err:
            raise TemplateFailed(err) from err

    def _writes_end_of_turn(self) -> bool:
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        try:
            text = self._apply(probe, None, False)
        except Exception:  # a template that needs more (a system turn, ...): assume it closes
            return True
        return bool(text[text.rfind("hello") + len("hello") :].strip())

    def generation_spans(self, conv: Conversation, upto: int) -> tuple[str, list[tuple[int, int]]]:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            (text,), (spans,) = render_jinja_template(
                conversations=[conv.messages[:upto]],
                tools=conv.tools,
                chat_template=self.tok.get_chat_template(),
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
                **self.kwargs,
            )
        except Exception as err:
            raise TemplateFailed(err) from err
        return text, [tuple(s) for s in spans]


def _has_generation(template: str) -> bool:
    import re

    return re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def _answers(conv: Conversation, where: Where) -> list[int]:
    answers = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    if answers[0] == 0:
        raise DataError(
            f"{_where(where)}: the first message is an assistant turn: there is no prompt"
        )
    return answers


def _span(r: Renderer, conv: Conversation, i: int, where: Where) -> tuple[str, int, int, bool]:
    """(text, a, b, spliced): the rendering that ends with answer i, and the answer's span
    in it. That is the conversation cut after the answer, when its prompt begins it; else
    (`spliced`) the prompt followed by the answer as the cut writes it (`_splice`)."""
    prompt, cut = r.text(conv, i, prompt=True), r.text(conv, i + 1)
    if cut.startswith(prompt):
        return cut, len(prompt), len(cut.rstrip()), False
    answer = _splice(r, conv, i, cut)
    if isinstance(answer, _Unspliced):
        at = next(
            (k for k, (x, y) in enumerate(zip(prompt, cut, strict=False)) if x != y),
            min(len(prompt), len(cut)),
        )
        raise DataError(
            f"{_where(where)}: assistant turn {i} (message {i}): the chat template writes the "
            f"conversation before this answer otherwise once the answer follows (at character "
            f"{at}: {prompt[at : at + 30]!r} as the model is prompted, {cut[at : at + 30]!r} "
            f"with the answer), and the answer cannot be cut out of the latter: {answer.why}; "
            f"{answer.fix}"
        )
    return prompt + answer, len(prompt), len(prompt) + len(answer), True


@dataclass
class _Unspliced:
    why: str  # what keeps the answer from being cut out of the rendering that holds it
    fix: str


_OTHER_TEMPLATE = (
    "use --chat-template FILE with a template that writes the generation prompt's own text "
    "before the answers it renders (or other --chat-template-kwargs)"
)


def _splice(r: Renderer, conv: Conversation, i: int, cut: str) -> str | _Unspliced:
    """Answer i as the rendering cut after it writes it (its content and end-of-turn text,
    less trailing whitespace), to follow the prompt the model sees when it generates it:
    what a template that writes the prompt otherwise once the answer follows trains on
    (Mistral-Nemo puts the system prompt into the last user turn only, so the cut has
    none). Where the answer begins in the cut is shown by a mark put before its content;
    for a tool call that a template writes without its content, by a plain answer of the
    mark in its place, whose rendering must then begin the cut. Why it cannot (and the
    fix) when it cannot."""
    if any(_MARK in str(m.get("content")) for m in conv.messages):
        return _Unspliced("its text holds the mark used to find it", "remove that conversation")
    # What the generation prompt adds after the conversation before the answer (e.g.
    # "<|im_start|>assistant\n"): the cut must write it right before the answer too, or the
    # model would be trained on an answer that follows another text than it sees.
    before, prompt = r.text(conv, i), r.text(conv, i, prompt=True)
    if not prompt.startswith(before):
        why = "its generation prompt rewrites the conversation before it"
        return _Unspliced(why, _OTHER_TEMPLATE)
    opening = prompt[len(before) :]
    message = conv.messages[i]
    content = message.get("content")
    messages = list(conv.messages[: i + 1])
    if isinstance(content, str):
        messages[i] = dict(message, content=_MARK + content)
        marked = r.text(Conversation(messages, conv.tools), i + 1)
        if marked.count(_MARK) == 1:
            head = marked[: marked.index(_MARK)]
            if not head.endswith(opening):
                return _opened_otherwise(head, opening)
            answer = marked[marked.index(_MARK) + len(_MARK) :].rstrip()
            if answer and cut.rstrip().endswith(answer):
                return answer
    if isinstance(content, str) and "</think>" in content:
        why = "the template rewrites or drops its think block, so where it begins is not known"
        fix = (
            "remove the think blocks from the answers (the generation prompt has the model "
            "answer without reasoning), or use other --chat-template-kwargs (e.g. not "
            '{"enable_thinking": false})'
        )
        return _Unspliced(why, fix)
    if not message.get("tool_calls"):
        why = "the template does not write its content once, as given, at its end"
        return _Unspliced(why, _OTHER_TEMPLATE)
    messages[i] = {"role": "assistant", "content": _MARK}
    marked = r.text(Conversation(messages, conv.tools), i + 1)
    head = marked[: marked.index(_MARK)] if marked.count(_MARK) == 1 else None
    if head is not None and not head.endswith(opening):
        return _opened_otherwise(head, opening)
    if head is None or not cut.startswith(head) or not cut[len(head) :].strip():
        why = (
            "the template writes the conversation before a tool call otherwise than before a "
            "text answer, so where the call begins is not known"
        )
        fix = (
            "remove the tool calls from such conversations, or use --chat-template FILE with a "
            "template that writes the conversation before a tool call as before a text answer"
        )
        return _Unspliced(why, fix)
    return cut[len(head) :].rstrip()


def _opened_otherwise(head: str, opening: str) -> _Unspliced:
    why = (
        f"in a conversation that holds it, the template writes {head[-30:]!r} before it, not "
        f"the generation prompt {opening!r} that the model answers after"
    )
    return _Unspliced(why, _OTHER_TEMPLATE)


def render_conversation(
    r: Renderer, conv: Conversation, turns: str, where: Where
) -> tuple[list[ChatDocument], str]:
    """The documents that train `conv` under `--chat-turns turns`, and the mode used."""
    conv = chat_tools.convert(conv, r.tool_arguments, where)
    answers = _answers(conv, where)
    if turns == "last":
        return [_cut_document(r, conv, answers[-1], where)], "last"
    if turns in ("auto", "full"):
        full = r.text(conv, len(conv.messages))
        cuts = [_span(r, conv, i, where) for i in answers]
        if all(full.startswith(cut[:b]) for cut, _, b, _ in cuts):
            spans = [(a, b) for _, a, b, _ in cuts]
            return [_document(r, conv, len(conv.messages), full, spans, answers, where)], "full"
        if turns == "full":
            spans = [_located(r, conv, i, full, where) for i in answers]
            return [_document(r, conv, len(conv.messages), full, spans, answers, where)], "full"
    return [_cut_document(r, conv, i, where) for i in answers], "per_turn"


def _cut_document(r: Renderer, conv: Conversation, i: int, where: Where) -> ChatDocument:
    text, a, b, spliced = _span(r, conv, i, where)
    doc = _document(r, conv, i + 1, text, [(a, b)], [i], where, spliced)
    doc.spliced = spliced
    return doc


def _document(
    r: Renderer,
    conv: Conversation,
    upto: int,
    text: str,
    spans: list[tuple[int, int]],
    answers: list[int],
    where: Where,
    spliced: bool = False,
) -> ChatDocument:
    """The tokens of `text` (the rendering of the first `upto` messages, or a spliced one)
    and the mask of the answers (message indices `answers`) at `spans`, with their stop
    targets; each answer's trained text checked (chat_trained.py)."""
    if r.generation and not spliced:  # the template's own marks, of the answers at `spans`
        text, marked = r.generation_spans(conv, upto)
        first = min(a for a, _ in spans)
        # Each answer trains the marks from the end of its prompt to the next one's.
        for k, (i, (a, _)) in enumerate(zip(answers, spans, strict=True)):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(text)
            trained = "".join(text[max(x, a) : min(y, end)] for x, y in marked if x < end and y > a)
            check_answer(conv.messages[i], i, text, trained, r.closes, r.origin, where)
        spans = [(a, b) for a, b in marked if a >= first] if len(spans) == 1 else marked
        tokens = Tokens(r.tok, text, lambda: _where(where))
        mask = tokens.generation_mask(spans)
        if not mask.any():
            raise DataError(
                f"{_where(where)}: the chat template's {{% generation %}} blocks mark no token "
                "of this conversation; put each assistant turn's text (and its end-of-turn "
                "token) inside {% generation %} ... {% endgeneration %}"
            )
        ends = tuple(sorted(tokens.tokens_before(b) for _, b in spans))
        return ChatDocument(tokens.all_ids(), mask, False, upto, answer_ends=ends)
    for i, (a, b) in zip(answers, spans, strict=True):
        check_answer(conv.messages[i], i, text, text[a:b], r.closes, r.origin, where)
    eos_target = False
    ends = [b for _, b in spans]  # characters
    if not r.closes:  # no end-of-turn text: the next turn's first token, or the EOS
        targets = []
        for k, (_, b) in enumerate(spans):
            rest = text[b:]
            start = b + len(rest) - len(rest.lstrip())
            if start < len(text):
                targets.append((start, start + 1))
                ends[k] = start + 1
            else:
                eos_target = True
                ends[k] = len(text)  # its stop target is the EOS: the document's own end
        spans = spans + targets
    tokens = Tokens(r.tok, text, lambda: _where(where))
    ids, mask = tokens.all_ids(), tokens.located_mask(spans)
    answer_ends = tuple(sorted(tokens.tokens_before(b) for b in ends))
    return ChatDocument(ids, mask, eos_target, upto, answer_ends=answer_ends)


def _located(r: Renderer, conv: Conversation, i: int, full: str, where: Where) -> tuple[int, int]:
    """Answer i's span in the full rendering as it shows there: from the end of its prompt to
    the end of its content (found by a marker appended to it) and its end-of-turn text."""
    turn = f"{_where(where)}: assistant turn {i} (message {i})"
    prompt = r.text(conv, i, prompt=True)
    if not full.startswith(prompt):
        raise DataError(
            f"{turn}: the chat template renders the earlier turns differently when this turn "
            f"follows, so --chat-turns full cannot train it in the full rendering; {_FIX}"
        )
    content = conv.messages[i].get("content")
    if not isinstance(content, str) or any(_MARK in str(m.get("content")) for m in conv.messages):
        raise DataError(f"{turn}: its content cannot be located in the full rendering; {_FIX}")
    messages = list(conv.messages)
    messages[i] = dict(messages[i], content=content + _MARK)
    marked = Conversation(messages, conv.tools)
    full_marked = r.text(marked, len(messages))
    if full_marked.count(_MARK) != 1:
        raise DataError(
            f"{turn}: the chat template shows its content {full_marked.count(_MARK)} times in "
            f"the rendering, not once, so the turn cannot be located; {_FIX}"
        )
    after = full_marked[full_marked.index(_MARK) + len(_MARK) :]
    end = len(full) - len(after)
    if not full.endswith(after) or end < len(prompt):
        raise DataError(
            f"{turn}: the chat template renders the rest of the conversation differently when "
            f"the turn's content changes, so its end cannot be located; {_FIX}"
        )
    last = r.text(marked, i + 1)
    closing = last[last.index(_MARK) + len(_MARK) :].rstrip()
    if not full.startswith(closing, end):
        raise DataError(
            f"{turn}: its end-of-turn text {closing!r} does not follow its content in the full "
            f"rendering ({full[end : end + 30]!r}); {_FIX}"
        )
    return len(prompt), end + len(closing)


def render_chat(
    tok: Any, messages: list[dict[str, Any]], where: Where
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation in one document (`--chat-turns full`), EOS not
    included: what the tests of the published templates compare with."""
    (doc,), _ = render_conversation(Renderer(tok), Conversation(messages), "full", where)
    return doc.ids, doc.mask
