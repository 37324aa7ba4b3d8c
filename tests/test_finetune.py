"""Fine-tuning on instruction data: `prepare --format chat|prompt_completion` writes a loss
mask beside the tokens, training packs whole conversations and averages the loss over the
masked-in tokens only, the same on every layout; from Hugging Face weights to an export
transformers reloads with the same loss."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moetrain import train
from moetrain.data.batch import IGNORE_INDEX
from moetrain.data.conversations import PackedConversations, check_some_fit
from moetrain.data.prepared import PreparedCorpus
from moetrain.prepare.cli import main as prepare
from moetrain.prepare.instructions import chat_tokenizer, render_chat
from tests.chat_model import (
    CHAT_DATA,
    SPECIALS,
    conversations,
    save_chat_model,
    save_chat_tokenizer,
)
from tests.distributed import ROOT, run_train

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "model"
    save_chat_model(directory)
    return directory


@pytest.fixture(scope="module")
def prepared(chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "chat"
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(CHAT_DATA)]
    assert (
        prepare([*argv, "--tokenizer", str(chat_model), "--out", str(out), "--workers", "1"]) == 0
    )
    return out


def _assistant_spans(tok, ids: list[int]) -> np.ndarray:
    """Independently of the renderer: from each `<|im_start|>assistant\\n` to the next
    `<|im_end|>`, that token included, found in token space."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = tok("assistant\n", add_special_tokens=False)["input_ids"]
    mask = np.zeros(len(ids), dtype=np.uint8)
    for p, token in enumerate(ids):
        if token == start and ids[p + 1 : p + 1 + len(header)] == header:
            q = p + 1 + len(header)
            stop = ids.index(end, q)
            mask[q : stop + 1] = 1
    return mask


def test_rendered_tokens_are_apply_chat_templates_and_the_mask_the_assistant_turns(chat_model):
    tok = chat_tokenizer(str(chat_model))
    for conv in conversations()[:12]:
        ids, mask = render_chat(tok, conv, "x:1")
        expected = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        assert ids.tolist() == list(expected)
        assert mask.tolist() == _assistant_spans(tok, ids.tolist()).tolist()
        assert mask.sum() > 0 and mask[-1] == 0  # the "\n" after the last <|im_end|>


def test_the_shards_carry_the_mask_and_the_samples_never_cut_a_conversation(chat_model, prepared):
    tok = chat_tokenizer(str(chat_model))
    corpus = PreparedCorpus.open(str(prepared))
    assert corpus.loss_mask and corpus.num_documents == len(conversations())
    # The trainer's EOS is the tokenizer's, <|im_end|>, which ChatML writes after every turn:
    # a conversation is still one document (ids and positions from the index, not from EOS).
    eos = tok.eos_token_id
    assert eos == tok.convert_tokens_to_ids("<|im_end|>")
    data = PackedConversations(corpus, 256, eos, True)
    assert data.left_out == 0 and len(data) < corpus.num_documents  # packed, never cut
    rendered = [render_chat(tok, conv, "x") for conv in conversations()]
    k = 0  # the conversations, in order, inside the samples
    for i in range(len(data)):
        sample = data[i]
        ids, labels = sample.input_ids.tolist(), sample.labels
        starts = [p for p in range(256) if sample.position_ids[p] == 0]
        for p in starts:
            if ids[p] == eos and (p + 1 == 256 or sample.position_ids[p + 1] == 0):
                continue  # padding: one EOS document each
            want, want_mask = rendered[k]
            n = len(want)
            assert ids[p : p + n] == want.tolist()  # whole, from its first token
            # A label counts where the mask marks the next token as a target.
            targets = np.asarray(want_mask.tolist() + [0])[1 : n + 1].astype(bool)
            counted = (labels[p : p + n] != IGNORE_INDEX).numpy()
            assert counted[: n - 1].tolist() == targets[: n - 1].tolist()
            assert (sample.document_ids[p : p + n] == sample.document_ids[p]).all()
            assert sample.position_ids[p : p + n].tolist() == list(range(min(n, 256 - p)))
            k += 1
    assert k == len(rendered)


def test_prompt_completion_trains_on_the_completion_and_eos(tmp_path):
    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": f"Q{i}: 2+{i}?", "completion": f" {2 + i}."} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["--source", "jsonl", "--format", "prompt_completion", "--path", str(path)]
    assert prepare([*argv, "--out", str(out), "--workers", "1"]) == 0
    mask = np.fromfile(out / "shard-00000.mask", dtype=np.uint8)
    expected = []
    for r in rows:
        expected += [0] * len(r["prompt"].encode()) + [1] * len(r["completion"].encode()) + [1]
    assert mask.tolist() == expected


def test_conversations_all_longer_than_a_sample_are_refused_before_training(
    tmp_path, capsys, monkeypatch
):
    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": "q" * (60 + i), "completion": "a" * 40} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prepared"
    argv = ["--source", "jsonl", "--format", "prompt_completion", "--path", str(path)]
    assert prepare([*argv, "--out", str(out), "--workers", "1"]) == 0
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    train_argv = [
        "--config=configs/debug_qwen3_moe.toml", "--data.source=tokens", f"--data.path={out}",
        "--data.max_tokens=none", "--data.seq_len=64", "--train.steps=1",
        f"--job.output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    capsys.readouterr()
    assert train.main(train_argv) == 2
    err = capsys.readouterr().err
    # The file, the cause (with the lengths: 101..105 tokens and an EOS) and the fix.
    assert f"data.path: {out}" in err and "every one of its 5 documents" in err
    assert "longer than data.seq_len + 1 = 65 tokens" in err
    assert "the shortest has 101 tokens, the longest 105" in err
    assert "raise data.seq_len to at least 100" in err
    assert not (tmp_path / "run").exists()  # refused before the run started
    # With one that fits, the others are left out with the start-up line's word, not refused.
    check_some_fit(np.array([200, 65, 300]), 64, "x")


def test_the_masked_loss_is_the_mean_over_masked_in_tokens(chat_model, prepared):
    tok = chat_tokenizer(str(chat_model))
    data = PackedConversations(
        PreparedCorpus.open(str(prepared)),
        128,
        tok.convert_tokens_to_ids(SPECIALS[0]),
        True,
    )
    batch = [data[i] for i in range(3)]
    logits = torch.randn(3, 128, 320, generator=torch.Generator().manual_seed(0))
    labels = torch.stack([b.labels for b in batch])
    ours = (
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        / (labels != IGNORE_INDEX).sum()
    )
    by_hand, count = 0.0, 0
    for b in range(3):
        for t in range(128):
            if labels[b, t] != IGNORE_INDEX:
                by_hand -= torch.log_softmax(logits[b, t].double(), -1)[labels[b, t]].item()
                count += 1
    assert count == int((labels != IGNORE_INDEX).sum()) > 0
    assert ours.item() == pytest.approx(by_hand / count, rel=1e-6)


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert prepare(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "line,expected",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
        ({"text": "hi"}, "no conversation in this record (its fields: 'text')"),
        ({"conversations": [{"from": "bot", "value": "hi"}]}, "is from 'bot'"),
        ({"messages": [{"role": "assistant", "content": None}]}, "content is NoneType"),
        ({"messages": [{"role": "user"}]}, "not an object with 'role' and 'content'"),
    ],
)
def test_bad_conversations_are_refused_by_line(chat_model, tmp_path, capsys, line, expected):
    path = tmp_path / "c.jsonl"
    good = json.dumps({"messages": conversations()[0]})
    path.write_text(f"{good}\n{json.dumps(line)}\n")
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer"]
    err = _refused([*argv, str(chat_model), "--out", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert f"{path}:2" in err and expected in err


def test_other_refusals(chat_model, tmp_path, capsys):
    plain = tmp_path / "plain"
    save_chat_tokenizer(plain, template=None)
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(CHAT_DATA), "--tokenizer"]
    err = _refused([*argv, str(plain), "--out", str(tmp_path / "o")], capsys)
    assert "has no chat template" in err and "--format prompt_completion" in err
    path = tmp_path / "pc.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    argv = ["--source", "jsonl", "--format", "prompt_completion", "--path", str(path)]
    err = _refused([*argv, "--out", str(tmp_path / "p"), "--workers", "1"], capsys)
    assert f"{path}:2" in err and "no 'completion' field" in err


# --- through train.py -------------------------------------------------------------------------


def _train_args(chat_model, prepared) -> list[str]:
    return [
        "--config=configs/debug_qwen3_moe.toml",
        "--data.source=tokens",
        f"--data.path={prepared}",
        f"--data.tokenizer={chat_model}",
        "--data.max_tokens=none",
        "--data.seq_len=128",
        "--train.steps=3",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--train.warmup_steps=1",
        "--metrics.log_interval=1",
    ]


@pytest.mark.slow
def test_every_layout_gives_the_same_masked_losses(chat_model, prepared, tmp_path):
    argv = _train_args(chat_model, prepared)
    one = run_train(argv, tmp_path / "one")
    assert all(0 < r["tokens"] < r["tokens_all"] for r in one)  # masked-in of all
    layouts = {
        "fsdp2": [],
        "ep2": ["--parallel.ep=2"],
        "cp2": ["--parallel.cp=2"],
        "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"],
    }
    for name, layout in layouts.items():
        records = run_train([*argv, *layout], tmp_path / name, nproc=2)
        assert [r["tokens"] for r in records] == [r["tokens"] for r in one], name
        for ours, ref in zip(records, one, strict=True):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5), name


@pytest.mark.slow
def test_from_hugging_face_weights_to_an_export_transformers_reloads(chat_model, tmp_path, capsys):
    """LoRA (adapters saved alone) on chat data from HF weights; the merged export holds the
    run's held-out loss, its tokenizer and template, and generation stops on the template's
    stop tokens; moetrain.generate on the checkpoint is transformers' greedy on the export."""
    held = conversations()[-4:]
    train_file, held_file = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_file.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()[:-4]))
    held_file.write_text("".join(json.dumps({"messages": c}) + "\n" for c in held))
    for name, path in (("train", train_file), ("held", held_file)):
        argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer"]
        assert (
            prepare([*argv, str(chat_model), "--out", str(tmp_path / name), "--workers", "1"]) == 0
        )
    tok = chat_tokenizer(str(chat_model))
    eos = tok.convert_tokens_to_ids(SPECIALS[0])
    windows = len(PackedConversations(PreparedCorpus.open(str(tmp_path / "held")), 256, eos, True))
    out = tmp_path / "run"
    argv = [
        "--config=configs/finetune_chat.toml",
        f"--model.init_from_hf={chat_model}",
        f"--data.tokenizer={chat_model}",
        f"--data.path={tmp_path / 'train'}",
        "--data.seq_len=256",
        "--train.steps=4",
        "--train.global_batch_size=4",
        "--train.lr=1e-3",
        "--train.warmup_steps=1",
        "--checkpoint.interval=4",
        "--peft.method=lora",
        f"--eval.path={tmp_path / 'held'}",
        f"--eval.samples={windows}",  # every held-out conversation
    ]
    records = run_train(argv, out, nproc=2)
    assert records[-1]["loss"] < records[0]["loss"]
    ours = records[-1]["eval_loss"]
    export = tmp_path / "export"
    step = out / "checkpoints" / "step-4"
    proc = subprocess.run(
        [sys.executable, "-m", "moetrain.export", "--checkpoint", str(step),
         "--out", str(export), "--dtype", "fp32"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    template = chat_model / "chat_template.jinja"
    assert f"tokenizer of {chat_model} with the chat template of {template}" in proc.stdout
    assert "generation stops on <|im_end|> (2)" in proc.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    total, count = 0.0, 0
    with torch.no_grad():
        for conv in held:  # each conversation on its own: what document masks give us
            ids, mask = render_chat(tok, conv, "held")
            ids = torch.tensor([*ids.tolist(), eos])[None]
            targets = torch.tensor([*mask.tolist(), 0])[1:].bool()
            logits = model(ids).logits[0, :-1].float()
            ce = F.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += ce[targets].double().sum().item()
            count += int(targets.sum())
    assert ours == pytest.approx(total / count, rel=1e-4)

    # transformers with the export's own tokenizer, template and stop tokens, against
    # moetrain.generate on the checkpoint: the same greedy tokens.
    from moetrain.generate.cli import main as generate

    exported = transformers.AutoTokenizer.from_pretrained(export)
    assert exported.chat_template == template.read_text()
    stops = model.generation_config.eos_token_id
    for conv in held[:3]:
        inputs = exported.apply_chat_template(
            conv[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            theirs = model.generate(**inputs, do_sample=False, max_new_tokens=24)
        theirs = theirs[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(theirs) == 24 or theirs[-1] in stops  # it stops on a stop token
        capsys.readouterr()
        argv = ["--checkpoint", str(step), "--chat", str(tmp_path / "chat.json"), "--json"]
        (tmp_path / "chat.json").write_text(json.dumps(conv[:-1]))
        assert generate([*argv, "--max-new-tokens", "24", "--device", "cpu"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["ids"] == theirs


def test_a_global_batch_without_a_masked_in_token_has_no_nan():
    import torch.distributed as dist

    from moetrain.data.batch import Batch
    from moetrain.loop.losses import BalanceTerms, LossScope, StepLoss
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.dims import ParallelDims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        spec = get_model_spec("qwen3_moe")
        args = spec.args_cls(vocab_size=64, hidden_size=32, intermediate_size=32,
                             moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, num_experts=4,
                             num_experts_per_tok=2)  # fmt: skip
        model = spec.build(args)
        model.init_weights(0)
        ids = torch.randint(0, 64, (2, 8))
        batch = Batch(
            ids,
            torch.full_like(ids, IGNORE_INDEX),
            torch.arange(8).expand(2, 8),
            torch.zeros_like(ids),
        )
        dims = ParallelDims.resolve(1, -1, 1, 1, 1)
        terms = spec.loss_terms(args)
        step = StepLoss(terms, BalanceTerms(), LossScope(dims, None, 2, 1, torch.device("cpu")))
        step.begin([batch])
        loss = step(model(batch.input_ids, batch.position_ids), batch)
        loss.backward()
        record = step.end()
        assert record["tokens"] == 0 and record["loss"] == 0.0 and record["tokens_all"] == 16
        assert torch.isfinite(loss) and all(
            torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
        )
    finally:
        dist.destroy_process_group()
