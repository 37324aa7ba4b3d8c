"""`python -m moetrain.generate` against transformers' own decoding, on a tiny Hugging Face
Qwen3-MoE with a chat tokenizer made in-process: the same greedy tokens on 3 prompts, the
same stop, and a --prompts file decoded in left-padded batches, every answer transformers'
greedy one and the full-forward decoder's. Its refusals: tests/test_generate_refusals.py;
the cache on other models: tests/test_generate_cache.py. (From a trained checkpoint and its
export, through train.py: tests/test_finetune.py's export test.)"""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.generate.batched import generate_batch
from moetrain.generate.cli import main
from moetrain.generate.decode import Sampling, generate_uncached
from moetrain.generate.load import load_model, load_tokenizer
from tests.chat_model import save_chat_model

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hello to the user."]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generate") / "model"
    save_chat_model(directory)
    return directory


def hf_greedy(directory, conversations: list, max_new: int, eos: list[int]) -> list[list[int]]:
    """transformers' greedy decoding of each conversation (a text: one user message), one
    at a time."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    out = []
    for conversation in conversations:
        if isinstance(conversation, str):
            conversation = [{"role": "user", "content": conversation}]
        inputs = tok.apply_chat_template(
            conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            ids = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def _prompt(tokenizer, conversation) -> list[int]:
    tok = tokenizer.tok
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


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
    model, plan = load_model("export", str(chat_model), torch.device("cpu"))
    prompt = _prompt(tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    [free] = generate_batch(model, plan, [prompt], set(), 12)
    assert not free.stopped and len(free.ids) == 12
    stop = free.ids[4]  # a token greedy decoding reaches: taken as the stop token
    first = free.ids.index(stop)
    [ours] = generate_batch(model, plan, [prompt], {stop}, 12)
    assert ours.stopped and ours.ids == free.ids[: first + 1]
    assert hf_greedy(chat_model, PROMPTS[:1], 12, [stop]) == [ours.ids]
    # Sampling: the seed decides the draws, each prompt's own, whatever the batch; they are
    # the full-forward decoder's draws.
    other = _prompt(tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    sampled = [
        generate_batch(model, plan, [prompt], set(), 8, Sampling(1.0, 0.9, seed))[0].ids
        for seed in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    beside = generate_batch(model, plan, [other, prompt], set(), 8, Sampling(1.0, 0.9, 1))
    assert beside[1].ids == sampled[0]
    assert generate_uncached(model, prompt, set(), 8, Sampling(1.0, 0.9, 1))[0] == sampled[0]


def test_a_prompts_file_is_answered_in_batches_as_one_at_a_time(chat_model, tmp_path, capsys):
    """Prompts of different lengths (chat and text lines, a blank line), batches of 2 (the
    last one short): each record is transformers' greedy answer to its line alone, and the
    full-forward decoder's; records in the file's order, with their line numbers."""
    conversations = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": PROMPTS[1]},
        ],
        PROMPTS[0],
        [{"role": "user", "content": "Say hello."}],
        PROMPTS[2] + " " + PROMPTS[0],
        "x",
    ]
    lines = [
        json.dumps({"prompt": c} if isinstance(c, str) else {"messages": c}) for c in conversations
    ]
    lines.insert(2, "")  # holds no prompt: the numbers of the lines after it say so
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "answers.jsonl"
    argv = [
        "--checkpoint",
        str(chat_model),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--max-new-tokens",
        "12",
        "--batch-size",
        "2",
        "--device",
        "cpu",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not (tmp_path / "answers.jsonl.partial").exists()
    assert [r["line"] for r in records] == [1, 2, 4, 5, 6]
    tokenizer = load_tokenizer("export", str(chat_model))
    eos = tokenizer.tok.eos_token_id
    assert [r["ids"] for r in records] == hf_greedy(chat_model, conversations, 12, [eos])
    model, _ = load_model("export", str(chat_model), torch.device("cpu"))
    prompts = [
        _prompt(tokenizer, [{"role": "user", "content": c}] if isinstance(c, str) else c)
        for c in conversations
    ]
    assert len({len(p) for p in prompts}) == len(prompts)  # every batch is padded
    for record, prompt in zip(records, prompts):
        ids, stopped = generate_uncached(model, prompt, {eos}, 12)
        assert (record["ids"], record["stopped"]) == (ids, stopped)
        answer = ids[:-1] if stopped else ids
        assert record["text"] == tokenizer.tok.decode(answer, skip_special_tokens=True)
    # Without --out the same records go to stdout, whatever the batch size.
    capsys.readouterr()
    assert main([*argv[:-4], "--batch-size", "5", "--device", "cpu"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == records


def test_a_failure_leaves_the_finished_answers_in_the_partial_file(
    chat_model, tmp_path, capsys, monkeypatch
):
    """Decoding fails in the second batch: --out is not written (nothing looks complete),
    and the first batch's answer is in FILE.partial, which the message names."""
    from moetrain.generate import batched

    calls = []

    def failing_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory, say")
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(batched, "generate_batch", failing_second_batch)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "answers.jsonl"
    argv = [
        "--checkpoint",
        str(chat_model),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="out of memory, say"):
        main(argv)
    assert not out.exists()
    [record] = [json.loads(line) for line in (tmp_path / "answers.jsonl.partial").open()]
    assert record["line"] == 1 and len(record["ids"]) == 4
    err = capsys.readouterr().err
    assert f"the answers finished before the failure (1 of 3) are in {out}.partial" in err
