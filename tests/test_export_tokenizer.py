"""The export carries the tokenizer the data was prepared with, as its checkpoint records it:
the files, the chat template the data was rendered with (`--chat-template` included) and
generation_config.json's stop tokens; a tokenizer changed or gone since is refused; a
byte-tokenizer run says in one line that it has none. The checkpoint and its export
generate alike. (Through train.py: tests/test_finetune.py's export test.)"""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.checkpoint.markers import TRAINER_STATE
from moetrain.checkpoint.tokenizer_record import tokenizer_record
from moetrain.config import load_config
from moetrain.errors import DataError
from moetrain.export.cli import main as export
from moetrain.hf.stop_tokens import template_stop_ids
from moetrain.prepare.cli import main as prepare
from tests.chat_model import CHAT_DATA, CHATML, save_chat_tokenizer
from tests.test_export import _checkpoint

transformers = pytest.importorskip("transformers")

# ChatML with a default system turn: not the tokenizer's own template, so the export
# carrying this one shows it is the --chat-template the data was rendered with.
WITH_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}"
    "{% endif %}" + CHATML
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tokenizer dir, template file, prepared chat corpus): the tokenizer's EOS is
    <|endoftext|>, so the template's <|im_end|> is a stop token only the probe finds."""
    root = tmp_path_factory.mktemp("tok")
    save_chat_tokenizer(root / "tok", eos="<|endoftext|>")
    template = root / "template.jinja"
    template.write_text(WITH_SYSTEM)
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(CHAT_DATA), "--workers", "1"]
    argv += ["--tokenizer", str(root / "tok"), "--chat-template", str(template)]
    assert prepare([*argv, "--out", str(root / "data")]) == 0
    return root / "tok", template, root / "data"


def _config(tok, data, *extra: str):
    return load_config([
        "--config=configs/debug_qwen3_moe.toml", "--data.source=tokens",
        f"--data.path={data}", f"--data.tokenizer={tok}", *extra,
    ])  # fmt: skip


def _recorded_checkpoint(tmp_path, record: dict):
    """A checkpoint of a random debug model whose state records `record`."""
    _, model, ckpt, _ = _checkpoint(tmp_path, ["--config=configs/debug_qwen3_moe.toml"], "run")
    state = torch.load(ckpt / TRAINER_STATE, weights_only=True)
    torch.save({**state, "tokenizer": record}, ckpt / TRAINER_STATE)
    return model, ckpt


def test_the_export_carries_the_tokenizer_template_and_stop_tokens(run, tmp_path, capsys):
    tok_dir, template, data = run
    record = tokenizer_record(_config(tok_dir, data))
    assert record["chat_template"] == WITH_SYSTEM
    assert record["chat_template_origin"] == f"--chat-template {template}"
    _, ckpt = _recorded_checkpoint(tmp_path, record)
    out = tmp_path / "export"
    capsys.readouterr()
    assert export(["--checkpoint", str(ckpt), "--out", str(out), "--dtype", "fp32"]) == 0
    said = capsys.readouterr().out
    assert f"tokenizer of {tok_dir} with the chat template of --chat-template {template}" in said
    assert "generation stops on <|endoftext|> (0), <|im_end|> (2)" in said
    names = sorted(p.name for p in out.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json",
                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == WITH_SYSTEM
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    # transformers renders and generates from it, stopping on the template's stop tokens.
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )  # fmt: skip
    assert tok.decode(inputs["input_ids"][0]).startswith("<|im_start|>system\nBe brief.")
    assert model.generation_config.eos_token_id == [0, 2]
    model.generate(**inputs, do_sample=False, max_new_tokens=4)

    # moetrain.generate on the checkpoint (its record) and on the export: the same tokens.
    from moetrain.generate.cli import main as generate

    answers = []
    for source in (ckpt, out):
        capsys.readouterr()
        argv = ["--checkpoint", str(source), "--prompt", "hi", "--max-new-tokens", "6", "--json"]
        assert generate([*argv, "--device", "cpu"]) == 0
        answers.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert answers[0] == answers[1] and answers[0]["prompt_ids"] == inputs["input_ids"][0].tolist()


def test_a_tokenizer_changed_or_gone_is_refused_before_any_work(run, tmp_path, capsys):
    tok_dir, _, data = run
    copy = tmp_path / "tok"
    copy.mkdir()
    for p in tok_dir.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    _, ckpt = _recorded_checkpoint(tmp_path, tokenizer_record(_config(copy, data)))
    out = tmp_path / "export"
    argv = ["--checkpoint", str(ckpt), "--out", str(out)]
    (copy / "tokenizer_config.json").write_text("{}")
    capsys.readouterr()
    assert export(argv) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'tokenizer_config.json'} has changed since the run started" in err
    assert f"trained on data prepared with the tokenizer in {copy}" in err
    assert "put that tokenizer back as it was, or export with the tokenizer left out" in err
    (copy / "tokenizer.json").unlink()
    assert export(argv) == 2
    assert f"{copy / 'tokenizer.json'} is gone" in capsys.readouterr().err
    assert not out.exists()  # nothing written
    assert export([*argv, "--no-tokenizer"]) == 0  # the way out the message names
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_byte_tokenizer_run_says_it_has_no_tokenizer_and_exports_the_model(tmp_path, capsys):
    _, ckpt = _recorded_checkpoint(tmp_path, tokenizer_record(load_config([])))
    out = tmp_path / "export"
    capsys.readouterr()
    assert export(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("no Hugging Face tokenizer to export: the run trained on the byte")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_template_changed_since_prepare_is_refused_at_start(run, tmp_path):
    tok_dir, template, data = run
    saved = template.read_text()
    template.write_text(saved + "{# edited #}")
    try:
        with pytest.raises(DataError) as err:
            tokenizer_record(_config(tok_dir, data))
    finally:
        template.write_text(saved)
    message = str(err.value)
    assert f"but --chat-template {template} now holds another" in message
    assert "restore the file as it was, or prepare the data again with it" in message


def test_a_template_without_end_of_turn_text_stops_on_the_next_turn(tmp_path):
    # As GLM-4.5: an answer ends where the next turn's <|user|> begins.
    glm = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = save_chat_tokenizer(tmp_path / "glm", glm, specials, eos="<|endoftext|>")
    assert template_stop_ids(tok) == [tok.convert_tokens_to_ids("<|user|>")]
    chatml = save_chat_tokenizer(tmp_path / "chatml", eos="<|endoftext|>")
    assert template_stop_ids(chatml) == [chatml.convert_tokens_to_ids("<|im_end|>")]
