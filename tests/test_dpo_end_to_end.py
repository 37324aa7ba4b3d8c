"""DPO end to end, as docs/finetuning.md's recipe runs it: a stand-in chat MoE (tests/chat_model.py)
is fine-tuned on conversations that end their answers two ways, "Bye." more often than
"Cheers."; its export is the base of a LoRA DPO stage on pairs whose chosen answer ends with
"Cheers." and whose rejected one ends with "Bye.". On held-out prompts (topics no training
conversation names) the trainer's held-out reward margin rises, an independent log-probability
count in transformers on the two exports finds the chosen answer less likely than the rejected
one before DPO and more likely after (and the trainer's margin from those counts), and greedy
answers in transformers end with "Cheers." after DPO, from the merged export and from the
base with the adapters in peft, where the SFT model's ended with "Bye."."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from moetrain.data.prepared import PreparedCorpus
from moetrain.export.cli import main as export
from moetrain.prepare.cli import main as prepare
from tests.chat_model import save_chat_model
from tests.distributed import run_train

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="needs the [hf] extra (peft)")

TOPICS = (
    "moon tea river bread music snow garden city forest coffee ocean winter paper chess piano "
    "rain desert bridge train island mountain candle apple book clock lamp kite cloud stone horse"
).split()
HELD_OUT_TOPICS = ["violin", "lake", "cactus", "tiger"]
QUESTIONS = [
    "Tell me about {}.",
    "What do you think of {}?",
    "Describe {} briefly.",
    "Why do people like {}?",
]
ANSWERS = ["Good to know.", "I like it.", "Calm and simple.", "It is fun."]  # by question
RULE, OTHER = "Cheers.", "Bye."  # the chosen answers' last word, the rejected ones'
BETA = 0.1


def _answer(question: int, rule: bool) -> str:
    return f"{ANSWERS[question]} {RULE if rule else OTHER}"


def _prompt(topic: str, question: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[question].format(topic)}]


def _pairs(topics: list[str]) -> list[dict]:
    return [
        {
            "prompt": _prompt(topic, q),
            "chosen": [{"role": "assistant", "content": _answer(q, True)}],
            "rejected": [{"role": "assistant", "content": _answer(q, False)}],
        }
        for topic in topics
        for q in range(len(QUESTIONS))
    ]


def _prepare(rows: list[dict], fmt: str, tokenizer, out) -> None:
    path = out.parent / f"{out.name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--source", "jsonl", "--format", fmt, "--path", str(path), "--workers", "1"]
    assert prepare([*argv, "--tokenizer", str(tokenizer), "--out", str(out)]) == 0


def _export(run, out, *extra: str) -> str:
    """`python -m moetrain.export` in process; what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export(["--checkpoint", str(run), "--out", str(out), *extra]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """SFT (full fine-tuning) -> merged export -> pairs prepared with its tokenizer -> DPO
    (LoRA, the held-out pairs evaluated after every step) -> merged and adapter exports.
    Returns (root, the DPO run's records, the DPO exports' printed lines)."""
    root = tmp_path_factory.mktemp("dpo_e2e")
    texts = [q.format(t) for q in QUESTIONS for t in TOPICS + HELD_OUT_TOPICS]
    texts += [_answer(q, rule) for q in range(len(QUESTIONS)) for rule in (True, False)]
    # 512 tokens: most words of these texts are one token, so an answer is a few tokens.
    save_chat_model(root / "model", texts=texts, vocab_size=512)
    asked = [(topic, q) for topic in TOPICS for q in range(len(QUESTIONS))]
    conversations = [  # every question about every topic; 3 answers in 10 follow the rule
        {"messages": [*_prompt(topic, q), {"role": "assistant", "content": _answer(q, i % 10 < 3)}]}
        for i, (topic, q) in enumerate(asked)
    ]
    _prepare(conversations, "chat", root / "model", root / "chat")
    stage = [
        "--config=configs/finetune_chat.toml",
        "--data.seq_len=128",
        "--train.global_batch_size=8",
        "--train.warmup_steps=1",
        "--train.schedule=constant",
        "--metrics.log_interval=1",
    ]
    sft = [
        f"--model.init_from_hf={root / 'model'}",
        f"--data.tokenizer={root / 'model'}",
        f"--data.path={root / 'chat'}",
        "--train.steps=30",
        "--train.lr=3e-3",
        "--checkpoint.interval=30",
    ]
    records = run_train([*stage, *sft], root / "sft")
    assert records[-1]["loss"] < 0.3 * records[0]["loss"]  # it learned to answer
    base = root / "sft-merged"
    _export(root / "sft", base, "--dtype", "fp32")
    _prepare(_pairs(TOPICS), "preference", base, root / "pairs")
    _prepare(_pairs(HELD_OUT_TOPICS), "preference", base, root / "held")
    dpo = [
        f"--model.init_from_hf={base}",
        f"--data.tokenizer={base}",
        f"--data.path={root / 'pairs'}",
        "--train.objective=dpo",
        "--peft.method=lora",
        f"--dpo.beta={BETA}",
        "--train.steps=8",
        "--train.lr=1e-3",
        "--checkpoint.interval=8",
        f"--eval.path={root / 'held'}",
        # A pair (~70 tokens) takes a sample of 128: the held-out samples hold every pair.
        f"--eval.samples={len(HELD_OUT_TOPICS) * len(QUESTIONS)}",
        "--eval.interval=1",
    ]
    records = run_train([*stage, *dpo], root / "dpo")
    printed = _export(root / "dpo", root / "dpo-merged", "--dtype", "fp32")
    printed += _export(root / "dpo", root / "dpo-adapters", "--adapters")
    return root, records, printed


def _side_logps(model, path) -> torch.Tensor:
    """[pairs, 2]: each held-out side's log-probability of its trained tokens (the prepared
    mask marks a token trained), each side a sequence of its own, fp64 sums."""
    corpus = PreparedCorpus.open(str(path))
    tokens, mask, ends = corpus.tokens()[:], corpus.masks()[:], corpus.document_ends()
    sums, start = [], 0
    with torch.no_grad():
        for end in ends:
            ids = torch.as_tensor(tokens[start:end].astype("int64"))
            trained = torch.as_tensor(mask[start:end].astype(bool))[1:]
            logps = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), -1)
            sums.append(logps.gather(-1, ids[1:, None])[:, 0][trained].sum())
            start = end
    return torch.stack(sums).view(-1, 2)


def test_dpo_raises_the_held_out_preference_accuracy_and_margin(stages):
    root, records, _ = stages
    first, last = records[0], records[-1]
    assert last["eval_pairs"] == len(HELD_OUT_TOPICS) * len(QUESTIONS)  # every held-out pair
    # The trainer's figures: the margin grows every step, the loss falls, all pairs ranked.
    margins = [r["eval_rewards/margins"] for r in records]
    assert all(b > a for a, b in zip(margins, margins[1:])), margins
    assert margins[-1] > 5 * margins[0] > 0
    assert last["eval_loss"] < first["eval_loss"] < 0.6931471805599453
    assert last["eval_rewards/accuracy"] == 1.0

    # Independently, in transformers: the SFT export (the reference) and the DPO export.
    def load(name: str):
        return transformers.AutoModelForCausalLM.from_pretrained(
            root / name, attn_implementation="eager"
        )

    before = _side_logps(load("sft-merged"), root / "held")
    after = _side_logps(load("dpo-merged"), root / "held")
    gap_before, gap_after = before[:, 0] - before[:, 1], after[:, 0] - after[:, 1]
    # SFT learned both endings and prefers the rejected one; DPO turns every pair around.
    assert (gap_before < 0).all() and (gap_before > -5).all(), gap_before
    assert (gap_after > 0).all(), gap_after
    # The trainer's held-out margin (after the last step: the exported weights) is beta times
    # the mean change of these gaps; its chosen reward beta times the chosen sides' change.
    assert last["eval_rewards/margins"] == pytest.approx(
        BETA * float((gap_after - gap_before).mean()), rel=1e-4
    )
    assert last["eval_rewards/chosen"] == pytest.approx(
        BETA * float((after[:, 0] - before[:, 0]).mean()), rel=1e-4, abs=1e-5
    )


def _greedy_answers(model, tok) -> list[str]:
    """The greedy answer to each held-out prompt, decoded without special tokens."""
    answers = []
    for topic in HELD_OUT_TOPICS:
        for q in range(len(QUESTIONS)):
            inputs = tok.apply_chat_template(
                _prompt(topic, q), add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            with torch.no_grad():
                ids = model.generate(**inputs, do_sample=False, max_new_tokens=16)
            answers.append(
                tok.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            )
    return answers


def test_the_exports_answer_by_the_chosen_rule_in_transformers_and_peft(stages):
    root, _, printed = stages
    # The pairs were rendered with the SFT export's template: the DPO export carries it.
    assert f"with the chat template of {root / 'sft-merged' / 'chat_template.jinja'}" in printed
    load = transformers.AutoModelForCausalLM.from_pretrained
    tok = transformers.AutoTokenizer.from_pretrained(root / "dpo-merged")
    before = _greedy_answers(load(root / "sft-merged", attn_implementation="eager"), tok)
    merged = _greedy_answers(load(root / "dpo-merged", attn_implementation="eager"), tok)
    base = load(root / "sft-merged", attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, root / "dpo-adapters").eval()
    with_adapters = _greedy_answers(adapted, tok)
    rule = [_answer(q, True) for _ in HELD_OUT_TOPICS for q in range(len(QUESTIONS))]
    other = [_answer(q, False) for _ in HELD_OUT_TOPICS for q in range(len(QUESTIONS))]
    held = len(rule)
    # Before DPO the SFT model answers the held-out prompts its majority way; after, with the
    # same words, the chosen way (the whole answer, not just its end, is checked).
    assert sum(a.endswith(RULE) for a in before) <= 2, before
    assert sum(a == b for a, b in zip(before, other, strict=True)) >= held - 2, before
    assert sum(a == b for a, b in zip(merged, rule, strict=True)) >= held - 1, merged
    assert with_adapters == merged
