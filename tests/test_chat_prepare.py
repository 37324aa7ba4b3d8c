"""`prepare --format chat` as a user runs it: `--chat-turns` and what it costs, the EOS a
template without end-of-turn text trains, template options in the plan and the repeat
command, and conversations from a Hugging Face dataset in either layout (`messages`,
ShareGPT's `conversations`). The renderings themselves: tests/test_published_templates.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain.data.prepared import PreparedCorpus
from moetrain.prepare.cli import main as prepare
from tests.chat_model import CHATML, SPECIALS, conversations, save_chat_tokenizer

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

# A template that writes no end-of-turn text (as GLM-4.5's): a turn ends where the next
# begins, and the last answer where the document does.
NO_END = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    root = tmp_path_factory.mktemp("chats")
    path = root / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()[:8]))
    return root, path


def _prepare(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = prepare([*argv, "--workers", "1"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chat_turns_say_what_they_cost_and_per_turn_trains_each_answer_once(chats, capsys):
    root, path = chats
    save_chat_tokenizer(root / "tok", CHATML)
    base = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(root / "tok")]  # fmt: skip
    answers = sum(m["role"] == "assistant" for c in conversations()[:8] for m in c)
    code, out, _ = _prepare([*base, "--out", str(root / "auto")], capsys)
    assert code == 0 and "chat turns: 8 conversations (8 full) in 8 documents" in out
    assert "1.00x the tokens of one rendering per conversation" in out
    code, out, _ = _prepare([*base, "--out", str(root / "per"), "--chat-turns", "per_turn"], capsys)
    assert code == 0 and f"(8 per_turn) in {answers} documents" in out
    corpus = PreparedCorpus.open(str(root / "per"))
    tokens, mask = corpus.tokens()[:], corpus.masks()[:]
    im_end = 2  # SPECIALS: <|endoftext|>, <|im_start|>, <|im_end|>
    assert SPECIALS[im_end] == "<|im_end|>"
    assert int(((tokens == im_end) & (mask == 1)).sum()) == answers  # each answer once, stopped


def test_a_template_without_end_of_turn_text_trains_the_next_turn_and_the_eos(chats, capsys):
    root, path = chats
    save_chat_tokenizer(root / "noend", NO_END, eos="<|endoftext|>")
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(root / "noend"), "--out", str(root / "noend_out")]  # fmt: skip
    code, out, _ = _prepare(argv, capsys)
    assert code == 0, out
    corpus = PreparedCorpus.open(str(root / "noend_out"))
    tokens, mask = corpus.tokens()[:], corpus.masks()[:]
    ends = corpus.document_ends() - 1  # each document's EOS
    assert (tokens[ends] == 0).all() and (mask[ends] == 1).all()  # the last answer's stop
    start = 1  # <|im_start|>: the next turn's first token, trained after an answer
    trained_starts = int(((tokens == start) & (mask == 1)).sum())
    followed = sum(
        1 for c in conversations()[:8] for i, m in enumerate(c[:-1]) if m["role"] == "assistant"
    )
    assert trained_starts == followed


def test_template_options_are_part_of_the_plan_and_the_repeat_command(chats, capsys, tmp_path):
    root, path = chats
    template = tmp_path / "t.jinja"
    template.write_text("{%- if greet -%}{{- 'hello ' -}}{%- endif -%}" + CHATML)
    save_chat_tokenizer(root / "tok2", CHATML)
    base = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(root / "tok2"), "--chat-template", str(template), "--out", str(tmp_path / "o")]  # fmt: skip
    code, _, _ = _prepare(base, capsys)
    plain = PreparedCorpus.open(str(tmp_path / "o")).num_tokens
    code, _, err = _prepare([*base, "--chat-template-kwargs", '{"greet": true}'], capsys)
    assert code == 2 and "different" in err  # other options: other data, not a resume
    code, _, _ = _prepare(
        [*base, "--chat-template-kwargs", '{"greet": true}', "--overwrite"], capsys
    )
    corpus = PreparedCorpus.open(str(tmp_path / "o"))
    assert code == 0 and corpus.num_tokens > plain
    assert "--chat-template-kwargs '{\"greet\":true}'" in corpus.manifest.command
    for bad, said in (("[1]", "must be a JSON object"), ("{x", "is not JSON")):
        with pytest.raises(SystemExit) as exit_:
            prepare([*base, "--chat-template-kwargs", bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare(["--source", "jsonl", "--path", str(path), "--out", "x", "--chat-turns", "last"])
    assert "--chat-turns renders conversations: it needs --format chat" in capsys.readouterr().err


def test_conversations_from_a_dataset_in_either_layout(chats, capsys, tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs the [hf] extra (datasets)")
    root, path = chats
    save_chat_tokenizer(root / "tok3", CHATML)
    convs = conversations()[:6]
    sharegpt = {"human": "user", "gpt": "assistant", "system": "system"}
    back = {v: k for k, v in sharegpt.items()}
    layouts = {
        "messages": [{"messages": c} for c in convs],
        "sharegpt": [
            {"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in c]}
            for c in convs
        ],  # fmt: skip
    }
    prepared = {}
    for name, rows in layouts.items():
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / name))
        argv = ["--source", "hf_datasets", "--format", "chat", "--path", str(tmp_path / name),
                "--tokenizer", str(root / "tok3"), "--out", str(tmp_path / f"{name}_out")]  # fmt: skip
        code, out, err = _prepare(argv, capsys)
        assert code == 0, err
        corpus = PreparedCorpus.open(str(tmp_path / f"{name}_out"))
        prepared[name] = (corpus.tokens()[:], corpus.masks()[:])
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(jsonl), "--tokenizer",
            str(root / "tok3"), "--out", str(tmp_path / "jsonl_out")]  # fmt: skip
    assert _prepare(argv, capsys)[0] == 0
    corpus = PreparedCorpus.open(str(tmp_path / "jsonl_out"))
    for tokens, mask in prepared.values():  # the same bytes as the JSON lines give
        assert np.array_equal(tokens, corpus.tokens()[:]) and np.array_equal(
            mask, corpus.masks()[:]
        )
    datasets.Dataset.from_list([{"text": "hi", "id": 1}]).save_to_disk(str(tmp_path / "plain"))
    argv = ["--source", "hf_datasets", "--format", "chat", "--path", str(tmp_path / "plain"),
            "--tokenizer", str(root / "tok3"), "--out", str(tmp_path / "plain_out")]  # fmt: skip
    code, _, err = _prepare(argv, capsys)
    assert code == 2 and "has the columns ['text', 'id']" in err and "'conversations'" in err
