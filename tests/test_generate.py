"""`python -m trainer.generate` against transformers' own decoding, on a tiny Hugging Face
Qwen3-MoE with a chat tokenizer made in-process: the same greedy tokens on 3 prompts, the
same stop; and its refusals. (From a trained checkpoint and its export, through train.py:
tests/test_finetune.py's export test.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.chat_model import save_chat_model
from trainer.generate.cli import main
from trainer.generate.decode import Sampling, generate
from trainer.generate.load import load_model, load_tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hello to the user."]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generate") / "model"
    save_chat_model(directory)
    return directory


def hf_greedy(directory, prompts: list[str], max_new: int, eos: list[int]) -> list[list[int]]:
    """transformers' greedy decoding of each prompt as one user message."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    out = []
    for text in prompts:
        inputs = tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            ids = model.generate(
                **inputs, do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def test_greedy_is_transformers_greedy_token_for_token(chat_model, capsys):
    ours = []
    for text in PROMPTS:
        capsys.readouterr()
        argv = ["--checkpoint", str(chat_model), "--prompt", text, "--max-new-tokens", "16"]
        assert main([*argv, "--json", "--device", "cpu"]) == 0
        ours.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    eos = transformers.AutoTokenizer.from_pretrained(chat_model).eos_token_id
    theirs = hf_greedy(chat_model, PROMPTS, 16, [eos])
    assert [r["ids"] for r in ours] == theirs
    assert len({tuple(t) for t in theirs}) == 3  # three different answers, not one repeated


def test_it_stops_where_transformers_stops(chat_model):
    tokenizer = load_tokenizer("export", str(chat_model))
    model = load_model("export", str(chat_model), torch.device("cpu"))
    tok = tokenizer.tok
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    free, stopped = generate(model, prompt, set(), 12)
    assert not stopped and len(free) == 12
    stop = free[4]  # a token greedy decoding reaches: taken as the stop token
    first = free.index(stop)
    ours, stopped = generate(model, prompt, {stop}, 12)
    assert stopped and ours == free[: first + 1]
    assert hf_greedy(chat_model, PROMPTS[:1], 12, [stop]) == [ours]
    # Sampling: the seed decides the draws.
    sampled = [generate(model, prompt, set(), 8, Sampling(1.0, 0.9, seed))[0] for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_bad_input_is_refused_before_loading(chat_model, tmp_path, capsys):
    bad = tmp_path / "chat.json"
    bad.write_text('{"role": "user"}')
    cases = [
        (["--chat", str(bad)], f"--chat {bad}: holds a dict, not a list"),
        (["--prompt", "x", "--top-p", "0"], "--top-p 0: give a probability mass in (0, 1]"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: give at least 1"),
    ]
    for extra, expected in cases:
        capsys.readouterr()
        assert main(["--checkpoint", str(chat_model), *extra]) == 2
        assert expected in capsys.readouterr().err
    capsys.readouterr()
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err
