"""The chat templates the model families publish (tests/data/chat_templates/), each with a
small BPE tokenizer that carries the model's special tokens: every document that
`chat_turns.render_conversation` makes is `apply_chat_template`'s rendering of the messages
it renders, and its loss mask equals a search for the answers written here, independent of
chat_turns: from where each template's generation prompt ends to the end of the answer's
end-of-turn text (for GLM-4.5, which writes none, the next turn's first token, or the EOS
after the document). Every answer is trained exactly once, with its stop target.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moetrain.errors import DataError
from moetrain.prepare.chat_messages import Conversation
from moetrain.prepare.chat_turns import Renderer, render_conversation
from moetrain.prepare.instructions import chat_tokenizer
from tests.chat_model import save_chat_tokenizer
from tests.test_chat_templates import CONVERSATIONS, _m

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"


@dataclass(frozen=True)
class Family:
    specials: list[str]  # the first one the padding
    bos: str | None
    eos: str
    header: str  # regex: what the generation prompt ends with; an answer begins after it
    end: str | None  # regex: the end-of-turn text (None: the template writes none)
    stops: tuple[str, ...]  # the stop-target tokens, each trained once per answer
    kwargs: dict = field(default_factory=dict)


QWEN_TOOLS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DS_TOOLS = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]  # fmt: skip
FAMILIES = {
    "qwen3": Family(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", *QWEN_TOOLS],
        None, "<|im_end|>", r"<\|im_start\|>assistant\n", r"<\|im_end\|>", ("<|im_end|>",)),
    "llama3": Family(
        ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>",
        r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", r"<\|eot_id\|>",
        ("<|eot_id|>",)),
    # History turns open with "<｜Assistant｜></think>"; an answer after a tool's output has
    # no header: the generation prompt there is the rendering itself.
    "deepseek_v3_1": Family(
        ["<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
         "<｜Assistant｜>", "<think>", "</think>", *DS_TOOLS],
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
        "<｜Assistant｜></think>|<｜tool▁output▁end｜>(?!<｜tool▁output▁begin｜>)",
        "<｜end▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",)),
    # [INST] and [/INST] are plain text in Mixtral's vocabulary; the answer is " " + content.
    "mixtral": Family(["<unk>", "<s>", "</s>"], "<s>", "</s>", r" \[/INST\]", "</s>", ("</s>",)),
    "mistral_nemo": Family(
        ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>",
        r"\[/INST\]|\[/TOOL_RESULTS\]", "</s>", ("</s>",)),
    # No end-of-turn text: the model stops on the next turn's <|user|> or <|observation|>.
    "glm4_5": Family(
        ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
         "<|observation|>", "<think>", "</think>", *QWEN_TOOLS, "<arg_key>", "</arg_key>",
         "<arg_value>", "</arg_value>"], None, "<|endoftext|>", r"<\|assistant\|>", None,
        ("<|user|>", "<|observation|>")),
    "gpt_oss": Family(
        ["<|endoftext|>", "<|startoftext|>", "<|return|>", "<|start|>", "<|message|>",
         "<|channel|>", "<|end|>", "<|call|>", "<|constrain|>"], "<|startoftext|>",
        "<|return|>", r"<\|start\|>assistant", r"<\|end\|>|<\|return\|>|<\|call\|>",
        ("<|end|>", "<|return|>", "<|call|>")),
}  # fmt: skip
NULL_RAISES = ("qwen3", "deepseek_v3_1")
GLM_NEXT = re.compile(r"<\|user\|>|<\|observation\|>|<\|system\|>")

CONVS = [
    *CONVERSATIONS,
    [_m("system", "Keep count."), _m("user", "One?"), _m("assistant", "One."),
     _m("user", "Two?"), _m("assistant", "Two."), _m("user", "Three?"),
     _m("assistant", "Drei — 三, trois."), _m("user", "Four?"), _m("assistant", "Four.")],
    [_m("system", "Be brief."), _m("user", "Ready?"), _m("assistant", "Yes ✓.")],
]  # fmt: skip

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two whole numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                   "b": {"type": "integer"}}, "required": ["a", "b"]}}}]  # fmt: skip


def _tool_conversation(json_arguments: bool) -> list[dict]:
    """Two calls (content null, then ""), their results, and the answer."""

    def call(n: int, a: int, b: int) -> list[dict]:
        args = {"a": a, "b": b}
        function = {"name": "add", "arguments": json.dumps(args) if json_arguments else args}
        return [{"id": f"call{n}abcd", "type": "function", "function": function}]

    return [_m("system", "You can add."), _m("user", "What are 2+2 and 3+3?"),
            {"role": "assistant", "content": None, "tool_calls": call(1, 2, 2)},
            {"role": "tool", "tool_call_id": "call1abcd", "content": "result 4"},
            {"role": "assistant", "content": "", "tool_calls": call(2, 3, 3)},
            {"role": "tool", "tool_call_id": "call2abcd", "content": "result 6"},
            _m("assistant", "2+2 is 4 and 3+3 is 6.")]  # fmt: skip


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    texts = [m["content"] for conv in CONVS for m in conv] + ["What are 2+2 and 3+3? result"]
    out = {}
    for name, fam in FAMILIES.items():
        template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        directory = tmp_path_factory.mktemp(name)
        save_chat_tokenizer(directory, template, fam.specials, texts, bos=fam.bos, eos=fam.eos)
        out[name] = chat_tokenizer(str(directory))
    return out


def _blank(messages: list[dict]) -> list[dict]:
    return [dict(m, content="") if m.get("content", "") is None else m for m in messages]


def _reference(tok, name: str, messages: list, tools=None, **kwargs) -> tuple[list[int], str]:
    """apply_chat_template's ids and text. transformers drops a null content's key, which
    Qwen3's (`'</think>' in message.content`) and DeepSeek-V3.1's (`message['content'] is
    none`) templates cannot take: they get "" there, rendered as their null branch would."""
    if name in NULL_RAISES and any(m.get("content", "") is None for m in messages):
        with pytest.raises(Exception, match="content"):
            tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        messages = _blank(messages)
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **kwargs)
    return list(ids), tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def _answer_spans(fam: Family, text: str, header: str | None = None) -> list[tuple]:
    """Each answer as (start, end, stop): from after the generation prompt's end to the end
    of its end-of-turn text; for a template that writes none, to the end of its text, with
    its stop target the next turn's first token, or None: the EOS after the document."""
    spans = []
    for h in re.finditer(header or fam.header, text):
        a = h.end()
        if fam.end is not None:
            b = re.compile(fam.end).search(text, a).end()
            spans.append(((a, b), None))
        else:
            nxt = GLM_NEXT.search(text, a)
            b = nxt.start() if nxt else len(text)
            stop = (nxt.start(), nxt.end()) if nxt else None
            spans.append(((a, a + len(text[a:b].rstrip())), stop))
    return spans


def _expected(tok, fam: Family, text: str, last_only: bool, header=None) -> tuple[list, bool]:
    """(mask, eos_target) found by hand: a token is trained when its first character is in
    an answer's span or is its stop target."""
    spans = _answer_spans(fam, text, header)
    assert spans, text
    spans = spans[-1:] if last_only else spans
    chars = [s for s, _ in spans] + [stop for _, stop in spans if stop is not None]
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask = [int(any(a <= s < b for a, b in chars)) for s, _ in offsets]
    return mask, fam.end is None and spans[-1][1] is None


def _stops_trained(tok, fam: Family, docs) -> int:
    """How many stop targets the documents train: masked stop tokens and EOS targets."""
    stops = set(tok.convert_tokens_to_ids(list(fam.stops)))
    return sum(
        int(((d.mask == 1) & [i in stops for i in d.ids.tolist()]).sum()) for d in docs
    ) + sum(d.eos_target for d in docs)


def _check_documents(tok, name, conv, docs, mode, tools=None, kwargs=None, header=None):
    """Each document's ids are apply_chat_template's of the messages it renders, and its
    mask (and EOS target) the answers found by hand."""
    fam, kwargs = FAMILIES[name], kwargs or {}
    answers = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    if mode == "full":
        assert [d.rendered for d in docs] == [len(conv)]
    elif mode == "per_turn":
        assert [d.rendered for d in docs] == [i + 1 for i in answers]
    else:
        assert [d.rendered for d in docs] == [answers[-1] + 1]
    for doc in docs:
        ids, text = _reference(tok, name, conv[: doc.rendered], tools, **kwargs)
        assert doc.ids.tolist() == ids, (name, mode, doc.rendered)
        mask, eos_target = _expected(tok, fam, text, mode != "full", header)
        assert doc.mask.tolist() == mask, (name, mode, doc.rendered, text)
        assert doc.eos_target == eos_target, (name, mode, doc.rendered)


def _auto_mode(name: str, conv: list[dict]) -> str:
    """The mode auto picks, as each template determines it."""
    answers = [m for m in conv if m["role"] == "assistant"]
    if name == "qwen3":  # the last answer shows an empty think block, earlier ones none
        return "per_turn" if len(answers) > 1 else "full"
    if name == "gpt_oss":  # earlier answers end with <|end|>, the last with <|return|>
        return "per_turn" if len(answers) > 1 else "full"
    if name == "glm4_5":  # an earlier answer's reasoning is dropped once a question follows
        return "per_turn" if any("</think>" in m["content"] for m in answers[:-1]) else "full"
    if name == "mistral_nemo" and conv[0]["role"] == "system":  # in the last user turn only
        return "per_turn"
    return "full"


def _convs(name: str) -> list[list[dict]]:
    if name == "mistral_nemo":  # with a system prompt: the xfail case below
        return [c for c in CONVS if c[0]["role"] != "system"]
    return CONVS


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_documents_are_apply_chat_templates_and_train_every_answer_once(toks, name):
    tok, fam = toks[name], FAMILIES[name]
    r = Renderer(tok)
    for conv in _convs(name):
        answers = sum(m["role"] == "assistant" for m in conv)
        docs, mode = render_conversation(r, Conversation(conv), "auto", "x:1")
        assert mode == _auto_mode(name, conv), (name, conv)
        _check_documents(tok, name, conv, docs, mode)
        assert _stops_trained(tok, fam, docs) == answers, (name, conv)  # each once
        for turns in ("per_turn", "last", *(["full"] if mode == "full" else [])):
            docs, used = render_conversation(r, Conversation(conv), turns, "x:1")
            assert used == turns
            _check_documents(tok, name, conv, docs, used)
            if turns == "per_turn":
                assert [_stops_trained(tok, fam, [d]) for d in docs] == [1] * answers


def test_mistral_nemo_with_a_system_prompt_trains_each_answer_after_its_prompt(toks):
    """mistral_nemo.jinja writes the system prompt into a user turn only when it is the
    conversation's last message, so no rendering that ends with an answer holds it: each
    answer is trained after the prompt the model generates it from (the conversation
    before it with the generation prompt: system prompt included), then the answer and
    its "</s>" as the template writes them."""
    tok, conv = toks["mistral_nemo"], CONVERSATIONS[0]
    assert conv[0]["role"] == "system"
    docs, mode = render_conversation(Renderer(tok), Conversation(conv), "auto", "x:1")
    assert mode == "per_turn" and all(d.spliced for d in docs)
    answers = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    for i, doc in zip(answers, docs, strict=True):
        prompt = tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
        assert conv[0]["content"] in prompt  # the system prompt the model answers under
        text = prompt + conv[i]["content"] + "</s>"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert doc.ids.tolist() == ids
        start = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert doc.mask.tolist() == [0] * start + [1] * (len(ids) - start)
        assert not doc.eos_target


def test_mistral_nemo_with_a_system_prompt_trains_each_tool_call_after_its_prompt(toks):
    """A tool call has no text to find it by, so a plain answer stands in for it to show
    where the call begins in the rendering cut after it (was refused: "is not how the
    rendering that ends with it begins"). The call that follows the question is trained
    after the prompt with the system prompt; later answers follow a tool result, after
    which the template writes no system prompt, prompt or cut."""
    tok, conv = toks["mistral_nemo"], _tool_conversation(json_arguments=False)
    docs, mode = render_conversation(Renderer(tok), Conversation(conv, TOOLS), "auto", "x:1")
    assert mode == "per_turn" and [d.spliced for d in docs] == [True, False, False]
    call = '[TOOL_CALLS][{{"name": "add", "arguments": {{"a": {0}, "b": {0}}}, "id": "call{1}abcd"}}]</s>'
    answers = {2: call.format(2, 1), 4: call.format(3, 2), 6: "2+2 is 4 and 3+3 is 6.</s>"}
    for (i, answer), doc in zip(answers.items(), docs, strict=True):
        prompt = tok.apply_chat_template(
            conv[:i], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert ("You can add." in prompt) == (i == 2)
        assert tok.apply_chat_template(conv[: i + 1], tools=TOOLS, tokenize=False).endswith(answer)
        ids = tok(prompt + answer, add_special_tokens=False)["input_ids"]
        start = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert doc.ids.tolist() == ids
        assert doc.mask.tolist() == [0] * start + [1] * (len(ids) - start)


def test_tool_arguments_auto_finds_each_templates_form(toks):
    """--tool-arguments auto, by a probe call rendered both ways: JSON text for DeepSeek-V3.1
    (a mapping fails), a mapping where a text would be encoded twice (Llama-3, Mistral-Nemo,
    GPT-OSS) or fails (GLM-4.5), either for Qwen3 (it writes both alike) and Mixtral (it
    writes no tool call)."""
    found = {name: Renderer(tok).tool_arguments for name, tok in toks.items()}
    assert found == {
        "qwen3": "as_given",
        "llama3": "object",
        "deepseek_v3_1": "string",
        "mixtral": "as_given",
        "mistral_nemo": "object",
        "glm4_5": "object",
        "gpt_oss": "object",
    }
    assert Renderer(toks["qwen3"], tool_arguments="string").tool_arguments == "string"


# name: (the call's text in the rendering, the mode auto picks)
TOOL_CASES = {"qwen3": ('{"name": "add", "arguments": {"a": 2, "b": 2}}', "per_turn"),
              "llama3": ('{"name": "add", "parameters": {"a": 2, "b": 2}}', "full"),
              "deepseek_v3_1": ('add<｜tool▁sep｜>{"a": 2, "b": 2}', "full"),
              "glm4_5": ("<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2", "full"),
              "gpt_oss": ('to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}',
                          "full")}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_tool_calls_are_trained_and_their_results_and_the_tools_are_not(toks, name):
    tok, fam = toks[name], FAMILIES[name]
    conv = _tool_conversation(json_arguments=name == "deepseek_v3_1")
    call, auto = TOOL_CASES[name]
    r = Renderer(tok)
    for turns in ("auto", "per_turn", "last"):
        docs, mode = render_conversation(r, Conversation(conv, TOOLS), turns, "x:1")
        assert mode == (auto if turns == "auto" else turns)
        _check_documents(tok, name, conv, docs, mode, tools=TOOLS)
        if turns != "last":
            assert _stops_trained(tok, fam, docs) == 3  # two calls and the answer
        trained = "".join(tok.decode(d.ids[d.mask == 1]) for d in docs)
        rendered = tok.decode(docs[-1].ids)
        if turns != "last":
            assert call in trained and call.replace("2", "3") in trained
        assert "2+2 is 4 and 3+3 is 6." in trained
        for shown in ("result 4", "result 6", "Adds two whole numbers", "What are"):
            assert shown not in trained
            assert shown in rendered or (name == "deepseek_v3_1" and shown == "Adds two whole numbers")  # fmt: skip


def test_qwen3_without_thinking_renders_as_apply_chat_template_with_enable_thinking_false(toks):
    tok, kwargs = toks["qwen3"], {"enable_thinking": False}
    off, on = Renderer(tok, kwargs), Renderer(tok)
    assert tok.apply_chat_template(CONVERSATIONS[0][:4], add_generation_prompt=True, tokenize=False,
                                   **kwargs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # fmt: skip
    for conv in (CONVERSATIONS[0], CONVS[-1]):
        for turns in ("auto", "per_turn", "last"):
            docs, mode = render_conversation(off, Conversation(conv), turns, "x:1")
            # the empty think block is the generation prompt's now: only the text after it
            header = r"<\|im_start\|>assistant\n<think>\n\n</think>\n\n"
            _check_documents(tok, "qwen3", conv, docs, mode, kwargs=kwargs, header=header)
            default, _ = render_conversation(on, Conversation(conv), turns, "x:1")
            assert [d.ids.tolist() for d in docs] == [d.ids.tolist() for d in default]
            for d, e in zip(docs, default, strict=True):
                assert d.mask.sum() < e.mask.sum()
                assert "<think>" not in tok.decode(d.ids[d.mask == 1])
                assert tok.decode(e.ids[e.mask == 1]).startswith("<think>\n\n</think>\n\n")
    # Data with reasoning is not what enable_thinking=False generates: refused by turn.
    with pytest.raises(DataError, match="assistant turn 1 .* cannot be cut out"):
        render_conversation(off, Conversation(CONVERSATIONS[1]), "auto", "x:1")


def test_deepseek_v3_1_thinking_option_reaches_the_template(toks):
    tok = toks["deepseek_v3_1"]
    conv = CONVERSATIONS[0]
    for kwargs in ({"thinking": False}, {}):
        docs, mode = render_conversation(Renderer(tok, kwargs), Conversation(conv), "auto", "x")
        assert mode == "full"
        _check_documents(tok, "deepseek_v3_1", conv, docs, mode, kwargs=kwargs)
    # With thinking=True the generation prompt is "<｜Assistant｜><think>", but the published
    # template renders every answer in the history as "<｜Assistant｜></think>answer": no
    # rendering holds an answer as the model generates it then, so each is refused.
    assert tok.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=False,
                                   thinking=True).endswith("<｜Assistant｜><think>")  # fmt: skip
    for turns in ("auto", "per_turn", "last"):
        with pytest.raises(DataError, match="the answer cannot be cut out"):
            render_conversation(Renderer(tok, {"thinking": True}), Conversation(conv), turns, "x")


def test_vendored_templates_name_their_source_in_one_comment_line():
    for name in FAMILIES:
        first = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8").split("\n", 1)[0]
        assert re.fullmatch(r"\{#- source: \S+ .*\(copy: .*\); "
                            r"(verbatim|DERIVED .*|UNVERIFIED .*) -#\}", first), name  # fmt: skip
