"""Chat templates as the model families publish them, written here with the same
behaviours: each case's ids are `apply_chat_template`'s and its loss mask equals an
independent search for the assistant turns in the full rendering, on multi-turn
conversations with system prompts, empty assistant turns, think blocks and non-ASCII text.

- Qwen3-like: ChatML; the think block shows only in assistant turns after the last user
  message (earlier turns lose theirs), so no prefix of the conversation renders as the
  full one does.
- Qwen2.5-like: ChatML with a default system prompt when there is none.
- Llama-3-like: a BOS, role headers, trimmed content, <|eot_id|>.
- DeepSeek-like: a BOS, no newline after the role, the EOS ends each assistant turn.
- ChatML with {% generation %} blocks: the template marks the assistant's text itself.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain.prepare.cli import main as prepare
from moetrain.prepare.instructions import chat_tokenizer, render_chat
from tests.chat_model import save_chat_tokenizer

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set think = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set think = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + think + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN25_LIKE = (
    "{%- if messages[0].role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA3_LIKE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
DEEPSEEK_LIKE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- m.content + '\\n\\n' -}}"
    "{%- elif m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<｜Assistant｜>' + m.content + eos_token -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)
CHATML_GENERATION = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- m.content + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
DEEPSEEK_SPECIALS = ["<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                     "<｜User｜>", "<｜Assistant｜>"]  # fmt: skip

# name: (template, specials, bos, eos, (assistant header, end of its turn) for the search)
CASES = {
    "qwen3": (QWEN3_LIKE, CHATML_SPECIALS, None, "<|im_end|>",
              ("<|im_start|>assistant\n", "<|im_end|>")),
    "qwen2.5": (QWEN25_LIKE, CHATML_SPECIALS, None, "<|im_end|>",
                ("<|im_start|>assistant\n", "<|im_end|>")),
    "llama3": (LLAMA3_LIKE, LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>",
               ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")),
    "deepseek": (DEEPSEEK_LIKE, DEEPSEEK_SPECIALS, "<｜begin▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")),
    "chatml_generation": (CHATML_GENERATION, CHATML_SPECIALS, None, "<|im_end|>",
                          ("<|im_start|>assistant\n", "<|im_end|>")),
}  # fmt: skip


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = [
    [_m("system", "You answer in one line."), _m("user", "Name a prime."), _m("assistant", "Seven."),
     _m("user", "And an even one?"), _m("assistant", "Two, the only even prime.")],
    # Think blocks: Qwen3-like shows the last turn's, and drops the first's.
    [_m("user", "2+2?"), _m("assistant", "<think>\nadd them\n</think>\n\nFour."),
     _m("user", "Times three?"), _m("assistant", "<think>\n4*3\n</think>\n\nTwelve.")],
    # An empty assistant turn, in the middle and at the end.
    [_m("user", "Say nothing."), _m("assistant", ""), _m("user", "Now say hi."),
     _m("assistant", "Hi!"), _m("user", "Nothing again."), _m("assistant", "")],
    # Non-ASCII, and whitespace a template may trim.
    [_m("system", "Réponds en français, s'il te plaît."), _m("user", "Grüße? 日本語は？ 🎉"),
     _m("assistant", "  Bonjour — 你好, ça va ✓  \n"), _m("user", "Encore « une » fois."),
     _m("assistant", "Très bien: ĉiam pli 🎉.")],
    [_m("user", "One round only."), _m("assistant", "One answer.")],
]  # fmt: skip


def _expected_mask(full: str, offsets: list[tuple[int, int]], header: str, end: str) -> list[int]:
    """The assistant turns found by hand in the full rendering: from after each assistant
    header to the end of the next end-of-turn text, as character spans; a token is in the
    mask when its first character is in one."""
    spans, at = [], 0
    while (h := full.find(header, at)) >= 0:
        a = h + len(header)
        b = full.index(end, a) + len(end)
        spans.append((a, b))
        at = b
    return [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """Each case's tokenizer: a BPE trained here, its specials, the template."""
    out = {}
    texts = [m["content"] for conv in CONVERSATIONS for m in conv]
    for name, (template, specials, bos, eos, _) in CASES.items():
        directory = tmp_path_factory.mktemp(name.replace(".", "_"))
        save_chat_tokenizer(directory, template, specials, texts, bos=bos, eos=eos)
        out[name] = chat_tokenizer(str(directory))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_are_apply_chat_templates_and_the_mask_the_assistant_turns(tokenizers, name):
    tok, (header, end) = tokenizers[name], CASES[name][-1]
    for conv in CONVERSATIONS:
        ids, mask = render_chat(tok, conv, "x:1")
        assert ids.tolist() == list(tok.apply_chat_template(conv, tokenize=True, return_dict=False))
        full = tok.apply_chat_template(conv, tokenize=False)
        offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert mask.tolist() == _expected_mask(full, offsets, header, end), (name, conv)
        turns = sum(m["role"] == "assistant" for m in conv)
        assert full.count(header) == turns  # the search saw every turn
        # Every turn's end-of-turn token is a target: the model learns to stop.
        stop = tok.convert_tokens_to_ids(end)
        assert sum(mask[ids == stop]) == turns


def test_qwen3_trains_on_the_think_block_the_full_rendering_shows(tokenizers):
    tok = tokenizers["qwen3"]
    ids, mask = render_chat(tok, CONVERSATIONS[1], "x:1")
    trained = tok.decode(ids[mask == 1])
    assert "4*3" in trained and "Twelve." in trained and "Four." in trained
    assert "add them" not in tok.decode(ids)  # the earlier turn's reasoning is not shown


def test_a_conversation_no_rendering_can_mask_is_refused_by_turn(tmp_path, capsys):
    # The generation prompt opens a think block that no rendering of an answer shows: the
    # model would be trained on an answer after another text than it generates it from.
    template = CASES["qwen2.5"][0].replace(
        "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>' -}}"
    )
    assert "<think>" in template
    directory = tmp_path / "tok"
    save_chat_tokenizer(directory, template, CHATML_SPECIALS)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[4]}) + "\n")
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(directory), "--out", str(tmp_path / "o"), "--workers", "1"]  # fmt: skip
    assert prepare(argv) == 2
    err = capsys.readouterr().err
    assert f"{path}:1" in err and "assistant turn 1 (message 1)" in err
    assert "the answer cannot be cut out" in err and "--chat-template FILE" in err

    # The fix it names: another template for the same tokenizer, a Qwen2.5-like one.
    fixed = tmp_path / "template.jinja"
    fixed.write_text(CASES["qwen2.5"][0])
    assert prepare([*argv, "--chat-template", str(fixed), "--overwrite"]) == 0
    mask = np.fromfile(tmp_path / "o" / "shard-00000.mask", dtype=np.uint8)
    tok = chat_tokenizer(str(directory), str(fixed))
    assert mask[:-1].tolist() == render_chat(tok, CONVERSATIONS[4], "x")[1].tolist()  # + EOS


def test_a_prompt_written_otherwise_once_the_answer_follows_trains_after_that_prompt(tmp_path):
    """A header that counts the messages: each answer's cut renders another first line than
    its prompt. The answer is trained after the prompt it is generated from, as the cut
    writes it (--chat-turns per_turn, spliced)."""
    from moetrain.prepare.chat_messages import Conversation
    from moetrain.prepare.chat_turns import Renderer, render_conversation

    template = "{{- messages | length }} messages\n" + CASES["qwen2.5"][0]
    directory = tmp_path / "tok"
    tok = save_chat_tokenizer(directory, template, CHATML_SPECIALS)
    conv = CONVERSATIONS[0]
    docs, mode = render_conversation(Renderer(tok), Conversation(conv), "auto", "x:1")
    answers = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    assert mode == "per_turn" and [d.spliced for d in docs] == [True] * len(answers)
    for i, doc in zip(answers, docs, strict=True):
        prompt = tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
        assert prompt.startswith(f"{i} messages")
        text = prompt + conv[i]["content"] + "<|im_end|>"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        start = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert doc.ids.tolist() == ids
        assert doc.mask.tolist() == [0] * start + [1] * (len(ids) - start)


def test_the_byte_tokenizer_has_no_chat_template_and_reads_no_file_it_was_not_given(
    tmp_path, capsys, monkeypatch
):
    # A chat tokenizer in the working directory, which a refused command must not read.
    monkeypatch.chdir(tmp_path)
    save_chat_tokenizer(tmp_path, CASES["qwen2.5"][0], CHATML_SPECIALS)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    template = tmp_path / "template.jinja"
    template.write_text(CASES["qwen2.5"][0])
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--workers", "1"]
    for extra in ([], ["--tokenizer", "byte"], ["--chat-template", str(template)]):
        capsys.readouterr()
        assert prepare([*argv, *extra, "--out", str(tmp_path / "o")]) == 2, extra
        err = capsys.readouterr().err
        assert "--tokenizer byte" in err and "--tokenizer MODEL_DIR" in err, err
        assert "--format prompt_completion" in err
        assert not (tmp_path / "o").exists()  # refused before any work


def _chat_argv(tmp_path, conversations: list) -> list[str]:
    """A prepare command over `conversations` (one per line) with a ChatML tokenizer."""
    directory = tmp_path / "tok"
    save_chat_tokenizer(directory, CASES["qwen2.5"][0], CHATML_SPECIALS)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(directory), "--out", str(tmp_path / "o"), "--workers", "1"]  # fmt: skip


@pytest.mark.parametrize(
    "template,line,problem,fix",
    [
        ("{%- for m in messages -%}\n{{ m.content }\n{%- endfor -%}", 2, "unexpected '}'",
         "fix the Jinja syntax on that line"),
        ("{%- for m in messages -%}\n{%- if m.role == 'assistant' -%}{% generation %}"
         "{{ m.content }}{%- endif -%}\n{%- endfor -%}", 2, "looking for 'endgeneration'",
         "close each {% generation %} with {% endgeneration %}"),
    ],
    ids=["syntax", "unclosed_generation"],
)  # fmt: skip
def test_a_chat_template_that_does_not_compile_is_refused_by_line(
    tmp_path, capsys, template, line, problem, fix
):
    file = tmp_path / "t.jinja"
    file.write_text(template)
    argv = [*_chat_argv(tmp_path, CONVERSATIONS[:1]), "--chat-template", str(file)]
    assert prepare(argv) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {file}: line {line} of the template: " in err, err
    assert problem in err and fix in err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_what_a_chat_template_raises_is_refused_by_input_line(tmp_path, capsys):
    file = tmp_path / "t.jinja"
    file.write_text(
        "{%- if messages[0].role == 'system' -%}{{ raise_exception('System role not "
        "supported') }}{%- endif -%}" + CASES["qwen2.5"][0]
    )
    argv = _chat_argv(tmp_path, [CONVERSATIONS[4], CONVERSATIONS[0]])  # a system prompt: 2
    assert prepare([*argv, "--chat-template", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"c.jsonl:2: the chat template (--chat-template {file}) raised 'System role not " in err
    assert "change or remove that conversation" in err


def test_an_empty_chat_template_file_is_refused_by_name(tmp_path, capsys):
    file = tmp_path / "t.jinja"
    file.write_text("\n")
    assert prepare([*_chat_argv(tmp_path, CONVERSATIONS[:1]), "--chat-template", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {str(file)!r} is empty" in err and "has no chat template" not in err


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_long_conversation_tokenized_in_pieces_gives_apply_chat_templates_ids(
    tokenizers, name, monkeypatch
):
    """The shape of a 16 MB conversation at test size: its rendering is tokenized in pieces
    of a few hundred characters (chat_tokens.py), and ids and mask are the whole one's."""
    from moetrain.prepare import chat_tokens, long_docs

    for attr, value in (("PIECE_CHARS", 400), ("CHECK_CHARS", 64)):
        monkeypatch.setattr(long_docs, attr, value)
    monkeypatch.setattr(chat_tokens, "BATCH_CHARS", 1500)
    words = " ".join(m["content"] for conv in CONVERSATIONS for m in conv)
    conv = [_m("system", words), _m("user", words * 2), _m("assistant", words * 6),
            _m("user", "Again."), _m("assistant", words * 4 + "\nDone.")]  # fmt: skip
    tok, (header, end) = tokenizers[name], CASES[name][-1]
    full = tok.apply_chat_template(conv, tokenize=False)
    assert len(chat_tokens.Tokens(tok, full, lambda: "x").bases) > len(full) // 800  # cut
    ids, mask = render_chat(tok, conv, "x:1")
    assert ids.tolist() == list(tok.apply_chat_template(conv, tokenize=True, return_dict=False))
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert mask.tolist() == _expected_mask(full, offsets, header, end)


def test_an_instruction_line_over_the_limit_is_refused_by_line(tmp_path, capsys, monkeypatch):
    from moetrain.data import reader
    from moetrain.prepare import instructions

    monkeypatch.setattr(instructions, "MAX_LINE_BYTES", 4000)
    monkeypatch.setattr(reader, "READ_BYTES", 257)  # the line comes in many reads
    words = " ".join(m["content"] for conv in CONVERSATIONS for m in conv)
    long = [_m("user", "Say it all."), _m("assistant", words * 20)]
    argv = _chat_argv(tmp_path, [CONVERSATIONS[4], long, CONVERSATIONS[0]])
    assert prepare(argv) == 2
    err = capsys.readouterr().err
    assert f"c.jsonl:2: this conversation is longer than {4000 / 2**20:g} MiB" in err, err
    assert "split it into several lines" in err
