"""A prepared chat conversation is one document in training, whatever EOS ids it holds
(issue 53, item 1), through train.py.

DeepSeek-V3's chat template writes the tokenizer's EOS after every assistant answer, so a
multi-turn conversation holds EOS ids before its end; document ids, positions and masks
must come from the prepared document index, not from those ids. On a DeepSeek-like
corpus with data.document_mask=true the debug DeepSeek-V3 trains identically (losses,
masked-in token counts, grad norms) on 1 rank and on cp 2 x ep 2 (4 ranks); and the loss
of step 1, whose global batch is every conversation, equals the same initial model run on
each conversation alone (its own tensor, positions from 0), the masked token
cross-entropies summed and divided by their count. The conversations' ids and masks for
that are found independently (apply_chat_template; the assistant turns searched in token
space), and splitting the conversations at their EOS ids, as the old packing did, gives
another loss: the case under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moetrain.config import load_config
from moetrain.data.prepared import PreparedCorpus
from moetrain.models import get_model_spec
from moetrain.prepare.cli import main as prepare
from tests.chat_model import save_chat_tokenizer
from tests.distributed import run_train
from tests.test_chat_templates import CASES, CONVERSATIONS

transformers = pytest.importorskip("transformers")

TEMPLATE, SPECIALS, BOS, EOS, _ = CASES["deepseek"]  # EOS: <｜end▁of▁sentence｜>


def _alone(tok, conv: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """A conversation's ids as prepared (apply_chat_template's, then the document's EOS) and
    its loss mask, found in token space: after each <｜Assistant｜> to the next EOS, that
    EOS included (target t, predicting token t + 1, counts where token t + 1 is in it)."""
    eos, header = tok.eos_token_id, tok.convert_tokens_to_ids("<｜Assistant｜>")
    ids = [*tok.apply_chat_template(conv, tokenize=True, return_dict=False), eos]
    mask, inside = [], False
    for token in ids:
        mask.append(int(inside))
        inside = token == header or (inside and token != eos)
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)


def _mean_masked_ce(model, pieces: list[list[torch.Tensor]], targets: list[torch.Tensor]):
    """Each conversation's pieces run alone (positions from 0), their logits joined; the
    masked-in cross-entropies of all conversations summed, over their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for parts, counted in zip(pieces, targets, strict=True):
            logits = torch.cat(
                [model(p[None], torch.arange(len(p))[None]).logits[0] for p in parts]
            )
            ids = torch.cat(parts)
            ce = F.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")
            total += ce[counted[1:]].sum().item()
            count += int(counted[1:].sum())
    return total / count, count


@pytest.mark.slow
def test_deepseek_chat_documents_train_alike_on_layouts_and_as_conversations_alone(tmp_path):
    texts = [m["content"] for conv in CONVERSATIONS for m in conv]
    tok = save_chat_tokenizer(tmp_path / "tok", TEMPLATE, SPECIALS, texts, bos=BOS, eos=EOS)
    eos = tok.eos_token_id
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "prepared"
    argv = ["--source", "jsonl", "--format", "chat", "--path", str(path), "--tokenizer",
            str(tmp_path / "tok"), "--eos-token", EOS, "--out", str(out), "--workers", "1"]  # fmt: skip
    assert prepare(argv) == 0

    # The prepared stream is the conversations, one document each, and holds EOS ids inside
    # them (each answer but the last ends with one): a split there changes the loss.
    alone = [_alone(tok, conv) for conv in CONVERSATIONS]
    corpus = PreparedCorpus.open(str(out))
    tokens = np.asarray(corpus.tokens()[:])
    assert tokens.tolist() == torch.cat([ids for ids, _ in alone]).tolist()
    assert np.asarray(corpus.masks()[:]).tolist() == torch.cat([m for _, m in alone]).tolist()
    assert corpus.document_ends().tolist() == np.cumsum([len(i) for i, _ in alone]).tolist()
    inner = [int((ids[:-2] == eos).sum()) for ids, _ in alone]  # before the rendering's last
    assert inner == [sum(m["role"] == "assistant" for m in c) - 1 for c in CONVERSATIONS]
    assert sum(inner) == 5, inner
    lengths = [len(ids) for ids, _ in alone]  # 69, 70, 39, 148, 25 tokens

    # seq_len 192: windows of 193 tokens take [c0, c1, c2] and [c3, c4], whole; a global
    # batch of 2 samples is every conversation at step 1 (step 2 is epoch 2).
    assert max(lengths) <= 193 and sum(lengths[:3]) <= 193 < sum(lengths[:4])
    assert sum(lengths[3:]) <= 193
    common = [
        "--config=configs/debug_deepseek_v3.toml",
        "--data.source=tokens",
        f"--data.path={out}",
        f"--data.tokenizer={tmp_path / 'tok'}",
        f"--data.eos_token={EOS}",
        "--data.max_tokens=none",
        "--data.seq_len=192",
        "--data.document_mask=true",
        "--train.steps=2",
        "--train.warmup_steps=1",
        "--train.global_batch_size=2",
        "--train.micro_batch_size=1",
        "--metrics.log_interval=1",
    ]
    one = run_train(common, tmp_path / "one")
    layout = ["--parallel.cp=2", "--parallel.ep=2"]
    cp2_ep2 = run_train([*common, *layout], tmp_path / "cp2_ep2", nproc=4)
    assert len(one) == len(cp2_ep2) == 2
    for ours, ref in zip(cp2_ep2, one, strict=True):
        assert ours["tokens"] == ref["tokens"]
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)

    # Step 1 against the run's initial model on each conversation alone. The logged loss is
    # the token cross-entropy only (aux and MTP terms are logged apart).
    cfg = load_config(common)
    model = get_model_spec(cfg.model.name).build(cfg.model.args)
    model.init_weights(cfg.train.seed)
    targets = [mask for _, mask in alone]
    expected, count = _mean_masked_ce(model, [[ids] for ids, _ in alone], targets)
    assert one[0]["tokens"] == count
    assert one[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert cp2_ep2[0]["loss"] == pytest.approx(expected, rel=1e-5)

    # Split at each EOS id (the EOS ending its piece), as documents found from EOS ids were.
    split = []
    for ids, _ in alone:
        ends = (torch.nonzero(ids == eos).flatten() + 1).tolist()
        split.append([p for p in torch.tensor_split(ids, ends[:-1]) if len(p)])
    old, _ = _mean_masked_ce(model, split, targets)
    # (measured: 1.2e-3 relative at init; ten times the tolerance asserted above would do)
    assert abs(old - expected) / expected > 1e-4, (old, expected)
    print(f"step-1 loss {one[0]['loss']:.7f}, alone {expected:.7f}, split at EOS {old:.7f}")
    print("loss", [r["loss"] for r in one], [r["loss"] for r in cp2_ep2])
    print("grad_norm", [r["grad_norm"] for r in one], [r["grad_norm"] for r in cp2_ep2])
