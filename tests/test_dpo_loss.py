"""The DPO loss and its gradient against TRL's (`trl.DPOTrainer._compute_loss`, trl 1.16,
the `dev` extra): the same per-token log-probabilities of the same pairs, arranged as TRL
batches them (chosen rows then rejected rows, padded) and as this trainer packs them (pairs
as adjacent documents of packed samples, with a padding document), must give the same
loss and the same gradient within 1e-6, for each loss type, with RPO's NLL term, and with
label smoothing (conservative DPO, which trl 1.16 no longer has: its formula from trl 0.x's
`DPOTrainer.dpo_loss`, sigmoid branch, written out below)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.config.objective import DpoSection
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.loop.losses import BalanceTerms, LossScope
from moetrain.loop.preference import PreferenceLoss, per_document
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.spec import LossTerms
from moetrain.parallelisms.dims import ParallelDims

trl = pytest.importorskip("trl", reason="needs the [dev] extra (trl, the reference)")

PAIRS, LENGTH, VOCAB = 6, 12, 11


def _pairs(seed: int) -> dict:
    """Pair i: chosen row i, rejected row PAIRS + i (TRL's order), LENGTH tokens each, the
    completion starting at a different place in each row; logits a leaf; reference sums."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    starts = torch.randint(2, LENGTH - 2, (rows,), generator=g)
    starts[PAIRS:] = starts[:PAIRS]  # a pair's two sides: one prompt
    completion = (torch.arange(LENGTH) >= starts[:, None]).long()
    logits = torch.randn(rows, LENGTH, VOCAB, generator=g) * 2
    reference = torch.randn(rows, generator=g) * 5 - 20
    return {"ids": ids, "completion": completion, "logits": logits, "reference": reference}


def _trl_loss(case: dict, logits: torch.Tensor, loss_types: list, weights: list, beta: float):
    """trl.DPOTrainer._compute_loss on TRL's batch, the model's outputs being the given
    per-token log-probabilities (its fused head's `log_probs`: 0 where no completion)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    ids, completion = case["ids"], case["completion"]
    shift = completion[:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    outputs = SimpleNamespace(
        log_probs=logps * shift,
        entropy=torch.zeros_like(logps),
        mean_logits=torch.zeros_like(logps),
        is_top1=torch.zeros_like(logps, dtype=torch.bool),
    )
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=loss_types,
        loss_weights=weights,
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion,
        "ref_chosen_logps": case["reference"][:PAIRS],
        "ref_rejected_logps": case["reference"][PAIRS:],
    }
    return DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)


def _conservative_dpo(case: dict, logits: torch.Tensor, beta: float, smoothing: float):
    """trl 0.x `DPOTrainer.dpo_loss`, loss_type sigmoid with label_smoothing, on sequence
    log-probabilities summed over the completion tokens (its `concatenated_forward`)."""
    ids, shift = case["ids"], case["completion"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    sums = (logps * shift).sum(1)
    ratio = sums - case["reference"]
    margin = ratio[:PAIRS] - ratio[PAIRS:]
    losses = (
        -F.logsigmoid(beta * margin) * (1 - smoothing) - F.logsigmoid(-beta * margin) * smoothing
    )
    return losses.mean()


def _packed(case: dict, logits: torch.Tensor) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The pairs as this trainer packs them: two samples of PAIRS // 2 pairs each (chosen
    document 2j, rejected 2j + 1) and a padding document; (batch, logits [2, S, V], the
    reference's per-position values: each side's sum at its first trained position)."""
    ids, completion, reference = case["ids"], case["completion"], case["reference"]
    per_sample = PAIRS // 2
    width = 2 * per_sample * LENGTH + 3  # 3 padding positions, one document each
    samples = []
    for s in range(2):
        rows = [
            r for j in range(per_sample) for r in (s * per_sample + j, PAIRS + s * per_sample + j)
        ]
        labels = torch.full((width,), IGNORE_INDEX)
        docs = torch.zeros(width, dtype=torch.long)
        refs = torch.zeros(width)
        for k, r in enumerate(rows):
            a = k * LENGTH
            trained = completion[r, 1:].bool()  # position t predicts token t + 1
            labels[a : a + LENGTH - 1] = torch.where(trained, ids[r, 1:], IGNORE_INDEX)
            docs[a : a + LENGTH] = k
            refs[a + int(torch.argmax(trained.long()))] = reference[r]
        docs[2 * per_sample * LENGTH :] = torch.arange(3) + len(rows)
        flat_ids = torch.cat([ids[r] for r in rows] + [torch.zeros(3, dtype=torch.long)])
        flat_logits = torch.cat([logits[r] for r in rows] + [torch.zeros(3, VOCAB)])
        samples.append((flat_ids, labels, docs, refs, flat_logits))
    ids_, labels, docs, refs, packed = (torch.stack(t) for t in zip(*samples, strict=True))
    batch = Batch(ids_, labels, torch.arange(width).expand(2, width), docs)
    return batch, packed, refs


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ours(case: dict, logits: torch.Tensor, dpo: DpoSection) -> torch.Tensor:
    batch, packed, refs = _packed(case, logits)
    dims = ParallelDims.resolve(1, -1, 1, 1, 1)
    scope = LossScope(dims, None, 2, 1, torch.device("cpu"))
    width = batch.labels.shape[1]
    sums = per_document(refs.double(), batch.document_ids, width)  # a reference's sums
    loss = PreferenceLoss(LossTerms(), BalanceTerms(), scope, dpo, lambda mbs, _: [sums])
    loss.begin([batch])
    value = loss(CausalLMOutput(packed, None), batch)
    record = loss.end()
    assert record["pairs"] == PAIRS
    assert record["loss"] == pytest.approx(value.item(), rel=1e-6)
    return value


@pytest.mark.parametrize(
    "dpo, trl_types, trl_weights",
    [
        (DpoSection(beta=0.1), ["sigmoid"], [1.0]),
        (DpoSection(beta=0.3, loss="ipo"), ["ipo"], [1.0]),
        (DpoSection(beta=0.05, loss="hinge"), ["hinge"], [1.0]),
        (DpoSection(beta=0.1, nll_weight=0.7), ["sigmoid", "sft"], [1.0, 0.7]),  # RPO
        (DpoSection(beta=0.2, label_smoothing=0.15), None, None),  # conservative DPO
    ],
    ids=["sigmoid", "ipo", "hinge", "sigmoid_rpo", "sigmoid_label_smoothing"],
)
def test_loss_and_gradient_equal_trl(one_rank, dpo, trl_types, trl_weights):
    case = _pairs(seed=int(dpo.beta * 100))
    theirs_logits = case["logits"].clone().requires_grad_()
    ours_logits = case["logits"].clone().requires_grad_()
    if trl_types is None:
        theirs = _conservative_dpo(case, theirs_logits, dpo.beta, dpo.label_smoothing)
    else:
        theirs = _trl_loss(case, theirs_logits, trl_types, trl_weights, dpo.beta)
    ours = _ours(case, ours_logits, dpo)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    theirs.backward()
    ours.backward()
    assert theirs_logits.grad.abs().max() > 1e-3  # the comparison below is not of zeros
    assert (ours_logits.grad - theirs_logits.grad).abs().max() <= 1e-6


def test_each_loss_is_what_its_name_says_at_a_margin_of_zero(one_rank):
    """Policy = reference: sigmoid log 2, ipo 1 / (2 beta)^2, hinge 1; rewards all zero."""
    case = _pairs(seed=5)
    case["reference"] = torch.zeros(2 * PAIRS)
    batch, packed, _ = _packed(case, case["logits"])
    token = torch.log_softmax(packed.float(), -1).gather(-1, batch.labels.clamp(min=0)[..., None])
    refs = torch.where(batch.labels != IGNORE_INDEX, token[..., 0], 0.0)  # the policy itself
    sums = per_document(refs.double(), batch.document_ids, batch.labels.shape[1])
    expected = {"sigmoid": 0.6931471805599453, "ipo": 1 / (2 * 0.25) ** 2, "hinge": 1.0}
    for name, value in expected.items():
        dims = ParallelDims.resolve(1, -1, 1, 1, 1)
        scope = LossScope(dims, None, 2, 1, torch.device("cpu"))
        dpo = DpoSection(beta=0.25, loss=name)
        loss = PreferenceLoss(LossTerms(), BalanceTerms(), scope, dpo, lambda mbs, _: [sums])
        loss.begin([batch])
        loss(CausalLMOutput(packed, None), batch)
        record = loss.end()
        assert record["loss"] == pytest.approx(value, rel=1e-6), name
        assert record["rewards/chosen"] == record["rewards/rejected"] == 0.0
        assert record["rewards/accuracy"] == 0.0
