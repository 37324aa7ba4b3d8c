"""`python -m moetrain.generate`'s refusals: exit status 2 and one message naming the flag or
file (and line) and the fix, before any model loads. Bad prompt files are refused with an
empty directory as --checkpoint: they are read before the checkpoint is even resolved."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moetrain.checkpoint.markers import COMPLETE, METADATA, TRAINER_STATE
from moetrain.generate.cli import main
from tests.chat_model import save_chat_model

pytest.importorskip("transformers")

FIX = 'give one JSON object a line: {"messages": [...]} (rendered with the chat template) or'


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("refusals") / "model"
    save_chat_model(directory)
    return directory


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


# (file content, what the message says): each a --prompts file refused by file:line
PROMPT_FILES = {
    "empty": ("", "{f}: the file holds no prompt; " + FIX),
    "blank_lines_only": ("\n  \n\n", "{f}: the file holds no prompt; " + FIX),
    "not_json": ('{"prompt": "a"}\n{"prompt": \n', "{f}:2: not JSON (Expecting value"),
    "a_list": ('{"prompt": "a"}\n\n["a"]\n', "{f}:3: holds a list, not an object; " + FIX),
    "unknown_key": ('{"prompt": "a", "id": 1}\n', "{f}:1: unknown keys ['id']; " + FIX),
    "both_keys": (
        '{"prompt": "a", "messages": []}\n',
        "{f}:1: holds both of messages and prompt; " + FIX,
    ),
    "neither_key": ("{}\n", "{f}:1: holds neither of messages and prompt; " + FIX),
    "empty_prompt": ('{"prompt": ""}\n', "{f}:1: prompt must be a non-empty string, not ''"),
    "text_not_string": ('{"prompt": ["a"]}\n', "{f}:1: prompt must be a non-empty string"),
    "empty_messages": ('{"messages": []}\n', "{f}:1: the list of messages is empty; give a"),
    "bad_message": (
        '{"prompt": "a"}\n{"messages": [{"role": "user", "content": "a"}, {"role": 1}]}\n',
        '{f}:2: message 1 is not a role and a content; give a JSON list of {"role"',
    ),
}


@pytest.mark.parametrize("case", sorted(PROMPT_FILES))
def test_bad_prompts_files_are_refused_by_file_and_line(case, tmp_path, capsys):
    content, expected = PROMPT_FILES[case]
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    nothing = tmp_path / "empty"  # no model, no checkpoint: the file is read first
    nothing.mkdir()
    err = _refused(["--checkpoint", str(nothing), "--prompts", str(path)], capsys)
    assert expected.replace("{f}", f"--prompts {path}") in err, err


CHAT_FILES = {
    "empty": ("", "the file is empty; give a JSON list of"),
    "blank": ("\n \n", "the file is empty; give a JSON list of"),
    "empty_list": ("[]", "the list of messages is empty; give a JSON list of"),
    "a_dict": ('{"role": "user"}', "holds a dict, not a list; give a JSON list of"),
    "not_json": ("[{", "not JSON (Expecting property name"),
}


@pytest.mark.parametrize("case", sorted(CHAT_FILES))
def test_bad_chat_files_are_refused(case, tmp_path, capsys):
    content, expected = CHAT_FILES[case]
    path = tmp_path / "chat.json"
    path.write_text(content)
    err = _refused(["--checkpoint", str(tmp_path), "--chat", str(path)], capsys)
    assert f"--chat {path}: {expected}" in err, err


OPTIONS = {
    "top_p_ignored_when_greedy": (
        ["--top-p", "0.9"],
        "--top-p 0.9 would be ignored with --temperature 0 (greedy decoding draws nothing); "
        "give --temperature > 0 to sample, or leave --top-p out",
    ),
    "top_p_and_seed_ignored_when_greedy": (
        ["--top-p", "0.5", "--seed", "3", "--temperature", "0"],
        "--top-p 0.5 and --seed 3 would be ignored with --temperature 0 (greedy decoding "
        "draws nothing); give --temperature > 0 to sample, or leave --top-p and --seed out",
    ),
    "top_p_zero": (
        ["--top-p", "0", "--temperature", "1"],
        "--top-p 0: give a probability mass in (0, 1]",
    ),
    "top_p_negative": (
        ["--top-p", "-0.5", "--temperature", "1"],
        "--top-p -0.5: give a probability mass in (0, 1]",
    ),
    "top_p_above_one": (
        ["--top-p", "1.5", "--temperature", "1"],
        "--top-p 1.5: give a probability mass in (0, 1]",
    ),
    "top_p_nan": (
        ["--top-p", "nan", "--temperature", "1"],
        "--top-p nan: give a probability mass in (0, 1]",
    ),
    "temperature_negative": (["--temperature", "-1"], "--temperature -1: give 0 (greedy) or more"),
    "temperature_nan": (["--temperature", "nan"], "--temperature nan: give 0 (greedy) or more"),
    "no_new_tokens": (["--max-new-tokens", "0"], "--max-new-tokens 0: give at least 1"),
    "out_without_prompts": (
        ["--out", "x.jsonl"],
        "--out applies to --prompts FILE only; with --prompt or --chat the answer is printed",
    ),
    "out_and_batch_size_without_prompts": (
        ["--out", "x.jsonl", "--batch-size", "4"],
        "--out and --batch-size apply to --prompts FILE only",
    ),
    "batch_size_without_prompts": (
        ["--batch-size", "4"],
        "--batch-size applies to --prompts FILE only; with --prompt or --chat the answer is printed",
    ),
}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_bad_options_are_refused_naming_the_flags(case, chat_model, capsys):
    extra, expected = OPTIONS[case]
    err = _refused(["--checkpoint", str(chat_model), "--prompt", "x", *extra], capsys)
    assert expected in err, err


def test_bad_options_of_a_prompts_file_are_refused(chat_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    argv = ["--checkpoint", str(chat_model), "--prompts", str(prompts)]
    err = _refused([*argv, "--json"], capsys)
    assert "--json: --prompts always writes JSON lines; leave --json out" in err
    assert "--batch-size 0: give at least 1" in _refused([*argv, "--batch-size", "0"], capsys)
    for out in (tmp_path / "nowhere" / "a.jsonl", tmp_path):
        err = _refused([*argv, "--out", str(out)], capsys)
        assert f"--out {out}: give a file path in an existing directory" in err
    err = _refused(["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"], capsys)
    assert f"--checkpoint {tmp_path / 'nowhere'}: no such directory" in err


def test_an_export_without_a_tokenizer_is_refused(chat_model, tmp_path, capsys):
    export = tmp_path / "export"
    export.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(chat_model / name, export / name)
    err = _refused(["--checkpoint", str(export), "--prompt", "x"], capsys)
    assert f"{export} holds no tokenizer.json, so prompts cannot be tokenized" in err
    assert "copy the tokenizer files the model was trained with into it" in err


def test_a_checkpoint_without_a_tokenizer_record_is_refused(tmp_path, capsys):
    """A checkpoint saved before checkpoints recorded their tokenizer (the record is the
    only thing missing: the refusal comes before its weights would be read)."""
    step = tmp_path / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    torch.save({"step": 1, "config": {}}, step / TRAINER_STATE)
    (step / METADATA).write_bytes(b"")
    (step / COMPLETE).write_text(json.dumps({"step": 1, "committed_at": 0.0}))
    err = _refused(["--checkpoint", str(tmp_path), "--prompt", "x"], capsys)
    assert f"{step} records no tokenizer" in err, err
    assert "export it (python -m moetrain.export), copy the tokenizer files" in err
