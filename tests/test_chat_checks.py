"""What `prepare --format chat` refuses before it trains the wrong thing, with the published
templates (tests/data/chat_templates/): a template that does not write the answers it would
train, what a template raises (any exception), template options it cannot take, and
tool-call arguments in the form each template renders (`--tool-arguments`)."""

from __future__ import annotations

import json

import pytest

from moetrain.data.prepared import PreparedCorpus
from moetrain.prepare.cli import main as prepare
from tests.chat_model import save_chat_tokenizer
from tests.test_published_templates import CONVS, FAMILIES, TEMPLATES, TOOLS, _tool_conversation

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

DEEPSEEK_EOS = ["--eos-token", FAMILIES["deepseek_v3_1"].eos]  # none of the usual names


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """Model directories with the published templates of the families used here."""
    texts = [m["content"] for conv in CONVS for m in conv] + ["What are 2+2 and 3+3? result"]
    out = {}
    for name in ("qwen3", "deepseek_v3_1", "mistral_nemo"):
        fam, directory = FAMILIES[name], tmp_path_factory.mktemp(name)
        template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        save_chat_tokenizer(directory, template, fam.specials, texts, bos=fam.bos, eos=fam.eos)
        out[name] = directory
    return out


def _run(tmp_path, capsys, tokenizer, records: list[dict], *extra: str) -> tuple[int, str]:
    """prepare over `records` (one a line) into tmp_path/o: (exit status, stderr)."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = [
        "--source",
        "jsonl",
        "--format",
        "chat",
        "--path",
        str(path),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "1",
        *extra,
    ]
    capsys.readouterr()
    code = prepare(argv)
    return code, capsys.readouterr().err


def _trained(tmp_path, tokenizer) -> tuple[list[str], dict]:
    """The trained text of each document of tmp_path/o, and the plan's source."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    corpus = PreparedCorpus.open(str(tmp_path / "o"))
    tokens, mask = corpus.tokens()[:], corpus.masks()[:]
    ends = corpus.document_ends()
    texts = [tok.decode(tokens[a:b][mask[a:b] == 1]) for a, b in zip([0, *ends[:-1]], ends)]
    return texts, corpus.manifest.source


def test_a_template_that_does_not_write_the_answers_is_refused_by_line(
    tokenizers, tmp_path, capsys
):
    """Finding 1: a template that drops assistant content trained each answer's end-of-turn
    text alone (exit 0, nothing said); one that drops tool calls trained none of them."""
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    no_content = qwen3.replace("+ content.lstrip('\\n') }}", "}}").replace(
        "'\\n' + content }}", "'\\n' }}"
    )
    no_calls = qwen3.replace("{%- if message.tool_calls %}", "{%- if false %}")
    assert "+ content" in qwen3 and "+ content" not in no_content and no_calls != qwen3
    (tmp_path / "no_content.jinja").write_text(no_content)
    (tmp_path / "no_calls.jinja").write_text(no_calls)
    records = [{"messages": CONVS[-1]}, {"messages": CONVS[0]}]
    code, err = _run(
        tmp_path,
        capsys,
        tokenizers["qwen3"],
        records,
        "--chat-template",
        str(tmp_path / "no_content.jinja"),
    )
    assert code == 2, err
    assert "c.jsonl:1: assistant turn 2 (message 2): the chat template (--chat-template " in err
    assert "never writes it, not in the answer" in err and "'Yes ✓.' would not be trained" in err
    assert "render with a template that writes every assistant message" in err
    assert not (tmp_path / "o" / "shard-00000.tokens").exists()
    tools = [{"messages": _tool_conversation(json_arguments=False), "tools": TOOLS}]
    code, err = _run(
        tmp_path,
        capsys,
        tokenizers["qwen3"],
        tools,
        "--chat-template",
        str(tmp_path / "no_calls.jinja"),
        "--overwrite",
    )
    assert code == 2, err
    assert "c.jsonl:1: assistant turn 2 (message 2)" in err
    assert "does not write its tool call 'add' in the answer" in err
    # The published template itself trains both.
    assert _run(tmp_path, capsys, tokenizers["qwen3"], records + tools, "--overwrite")[0] == 0


def test_any_exception_a_template_raises_is_refused_by_line(tokenizers, tmp_path, capsys):
    """Finding 2: DeepSeek-V3.1 concatenates a call's arguments and name as text; a mapping
    (forced with --tool-arguments object) or a number was a bare TypeError traceback."""
    calls = _tool_conversation(json_arguments=False)
    plain = {"messages": CONVS[-1]}
    code, err = _run(
        tmp_path,
        capsys,
        tokenizers["deepseek_v3_1"],
        [plain, {"messages": calls, "tools": TOOLS}],
        "--tool-arguments",
        "object",
        *DEEPSEEK_EOS,
    )
    assert code == 2, err
    assert "c.jsonl:2: the chat template (the chat template of --tokenizer " in err
    assert 'failed (TypeError: can only concatenate str (not "dict") to str)' in err
    numbered = json.loads(json.dumps(calls))
    numbered[2]["tool_calls"][0]["function"]["name"] = 7
    code, err = _run(
        tmp_path,
        capsys,
        tokenizers["deepseek_v3_1"],
        [plain, plain, {"messages": numbered, "tools": TOOLS}],
        *DEEPSEEK_EOS,
    )
    assert code == 2, err
    assert "c.jsonl:3: the chat template" in err and '(not "int") to str' in err


@pytest.mark.parametrize(
    "options,said",
    [
        (
            '{"nosuch_option": true}',
            "key 'nosuch_option': the chat template (the chat template of --tokenizer",
        ),
        ('{"messages": []}', "key 'messages' is set by transformers' apply_chat_template itself"),
        ('{"add_generation_prompt": true}', "key 'add_generation_prompt' is set by transformers'"),
        ('{"eos_token": "x"}', "key 'eos_token' is set by transformers'"),
    ],
    ids=["unread", "messages", "add_generation_prompt", "special_token"],
)
def test_template_options_the_template_cannot_take_are_refused_by_key(
    tokenizers, tmp_path, capsys, options, said
):
    """Finding 3: an option Qwen3's template never reads was recorded in the plan and
    changed nothing; one transformers sets itself was a traceback or overrode it."""
    records = [{"messages": CONVS[-1]}]
    code, err = _run(
        tmp_path, capsys, tokenizers["qwen3"], records, "--chat-template-kwargs", options
    )
    assert code == 2, err
    assert f"--chat-template-kwargs {said}" in err
    if "nosuch" in options:  # the message lists what it reads
        assert "the options it reads: content, enable_thinking, reasoning_content" in err
    assert not (tmp_path / "o").exists()  # refused before any work
    code, err = _run(
        tmp_path,
        capsys,
        tokenizers["qwen3"],
        records,
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    assert code == 0, err


def test_tool_arguments_are_rendered_in_each_templates_form(tokenizers, tmp_path, capsys):
    """Finding 4: DeepSeek-V3.1 takes JSON text (a mapping failed), Mistral-Nemo a mapping (a
    JSON text was encoded twice, silently); auto converts each call, and the plan records
    the option and the form it resolved to."""
    as_objects = {"messages": _tool_conversation(json_arguments=False), "tools": TOOLS}
    as_text = {"messages": _tool_conversation(json_arguments=True), "tools": TOOLS}
    code, err = _run(tmp_path, capsys, tokenizers["deepseek_v3_1"], [as_objects], *DEEPSEEK_EOS)
    assert code == 0, err
    trained, source = _trained(tmp_path, tokenizers["deepseek_v3_1"])
    assert 'add<｜tool▁sep｜>{"a": 2, "b": 2}<｜tool▁call▁end｜>' in trained[0]
    assert (source["tool_arguments"], source["tool_arguments_rendered"]) == ("auto", "string")
    nemo = tokenizers["mistral_nemo"]
    (tmp_path / "n").mkdir()
    code, err = _run(tmp_path / "n", capsys, nemo, [as_text])
    assert code == 0, err
    trained, source = _trained(tmp_path / "n", nemo)
    calls = [t for t in trained if t.startswith("[TOOL_CALLS]")]
    assert calls == [
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 2}, "id": "call1abcd"}]</s>',
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 3}, "id": "call2abcd"}]</s>',
    ]
    assert (source["tool_arguments"], source["tool_arguments_rendered"]) == ("auto", "object")
    code, err = _run(
        tmp_path / "n", capsys, nemo, [as_text], "--tool-arguments", "string", "--overwrite"
    )
    assert code == 0, err  # forced: the text is encoded twice, as the user asked
    trained, source = _trained(tmp_path / "n", nemo)
    assert '"arguments": "{\\"a\\": 2, \\"b\\": 2}"' in trained[0]
    assert (
        "--tool-arguments string" in PreparedCorpus.open(str(tmp_path / "n" / "o")).manifest.command
    )
    # A text that is not a JSON object cannot become a mapping: refused by its line.
    code, err = _run(tmp_path / "n", capsys, nemo, [_bad_arguments(as_text)], "--overwrite")
    assert code == 2, err
    assert (
        "c.jsonl:1: message 2, tool call 0: its arguments are the text 'a=2, b=2', which is not JSON"
        in err
    )


def _bad_arguments(record: dict) -> dict:
    record = json.loads(json.dumps(record))
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = "a=2, b=2"
    return record
