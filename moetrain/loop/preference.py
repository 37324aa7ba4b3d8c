"""`train.objective=dpo`: the preference loss of one step, from whole-sequence log-probabilities.

A micro-batch's samples hold whole pairs (moetrain/data/conversations.py): its documents 2j
and 2j + 1 are pair j's chosen and rejected sides, each with its answer's tokens trained. A
side's log-probability is the sum over its trained tokens of log p(token), the policy's
(with gradient) and the reference's (`dpo.reference`: under LoRA the frozen base, the same
model with its adapters off, run without gradient before the step's first forward; under
full fine-tuning the initial model's sums, stored by a first pass before step 1 and looked
up by each document's content: moetrain/loop/stored_reference.py). With the log-ratios
r = policy - reference of each side and the margin h = r_chosen - r_rejected, a pair's loss
is (`[dpo]`, as TRL's DPOTrainer computes it):

- sigmoid: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h) (e: label_smoothing);
- ipo: (h' - 1 / (2 beta))^2, h' the margin of log-probabilities averaged over each side's
  trained tokens;
- hinge: relu(1 - beta h);

plus, with `dpo.nll_weight` (RPO), that weight times the chosen answers' next-token
cross-entropy, averaged over the global batch's chosen tokens. The step's loss is the mean
over the global batch's pairs: each forward adds its pairs' losses divided by the global pair
count (counted in `begin`, one all-reduce), so the gradients are one device's on the whole
batch for any data-parallel or expert-parallel layout ("One device's numbers"). The MoE aux
and z losses come from the policy's forward alone: the reference forward's router statistics
are dropped. The record adds what a user watches (TRL's names): rewards/chosen and
rewards/rejected (beta r, mean over pairs), rewards/margins, rewards/accuracy (the share of
pairs whose chosen reward is the higher), and nll (the chosen answers' mean cross-entropy).
A reference is NaN for a document it does not hold (a stored reference only): the step's
record counts those sides (`reference_missing`), and the trainer refuses the run at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain.build.lora import adapters_disabled
from moetrain.config.objective import DpoSection
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.loop.losses import BalanceTerms, LossScope, StepLoss, model_inputs
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.spec import LossTerms

# The figures a step (or an evaluation) sums over its pairs, in this order.
PAIR_FIGURES = ("loss", "nll", "chosen", "rejected", "accuracy")


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) of each position (fp32) of logits [B, S, V]; 0 where there is no label."""
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -ce.view(labels.shape)


def per_document(values: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """values [B, S] summed by document of their sample: [B, W], W = S rounded up to even
    (a sample holds at most S documents), column d the sum over document d's positions."""
    width = values.shape[1] + values.shape[1] % 2
    sums = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device)
    return sums.scatter_add(1, document_ids, values)


@dataclass(frozen=True)
class PairStats:
    """Per pair slot [B, W / 2] of one micro-batch (slots without a pair: `valid` False)."""

    policy: tuple[torch.Tensor, torch.Tensor]  # log-probability sums: chosen, rejected
    reference: tuple[torch.Tensor, torch.Tensor]
    tokens: tuple[torch.Tensor, torch.Tensor]  # trained tokens of each side
    valid: torch.Tensor  # bool

    @staticmethod
    def of(policy_logps: torch.Tensor, reference: torch.Tensor, batch: Batch) -> PairStats:
        """From the policy's per-position log-probabilities [B, S] (0 where untrained) and
        the reference's per-document sums [B, W] (float64, as a `Reference` gives them)."""
        # NOTE: summed in float64: a side of a thousand tokens sums to thousands, where fp32
        # keeps only ~1e-3 of the margin, a small difference of two such sums.
        ids = batch.document_ids
        counts = per_document((batch.labels != IGNORE_INDEX).double(), ids)
        policy = per_document(policy_logps.double(), ids)
        tokens = _sides(counts)
        return PairStats(_sides(policy), _sides(reference), tokens, tokens[0] > 0)


def _sides(per_doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's per-document values [B, W] as (chosen, rejected) [B, W / 2]: documents 2j
    and 2j + 1 are pair j's sides."""
    return per_doc[:, 0::2], per_doc[:, 1::2]


def pair_losses(stats: PairStats, dpo: DpoSection) -> torch.Tensor:
    """The loss of each pair slot [B, W / 2] (0 where there is no pair)."""
    chosen = stats.policy[0] - stats.reference[0]
    rejected = stats.policy[1] - stats.reference[1]
    if dpo.loss == "ipo":  # log-probabilities averaged over each side's trained tokens
        margin = chosen / stats.tokens[0].clamp(min=1) - rejected / stats.tokens[1].clamp(min=1)
        losses = (margin - 1 / (2 * dpo.beta)) ** 2
    elif dpo.loss == "hinge":
        losses = torch.relu(1 - dpo.beta * (chosen - rejected))
    else:
        scaled = dpo.beta * (chosen - rejected)
        losses = -F.logsigmoid(scaled)
        if dpo.label_smoothing:
            e = dpo.label_smoothing
            losses = (1 - e) * losses - e * F.logsigmoid(-scaled)
    return torch.where(stats.valid, losses, torch.zeros_like(losses))


def pair_sums(stats: PairStats, dpo: DpoSection) -> torch.Tensor:
    """PAIR_FIGURES summed over one micro-batch's pairs, [5] float64, with the gradient of the
    loss and nll sums (the rewards and accuracy are figures only)."""
    valid = stats.valid.float()
    chosen = (dpo.beta * (stats.policy[0] - stats.reference[0])).detach() * valid
    rejected = (dpo.beta * (stats.policy[1] - stats.reference[1])).detach() * valid
    return torch.stack(
        [
            pair_losses(stats, dpo).sum(),
            -(stats.policy[0] * valid).sum(),  # the chosen answers' cross-entropy sum
            chosen.sum(),
            rejected.sum(),
            ((chosen > rejected).float() * valid).sum(),
        ]
    )


def pair_counts(batch: Batch) -> torch.Tensor:
    """[pairs, chosen tokens] of one micro-batch, int64."""
    counts = per_document((batch.labels != IGNORE_INDEX).long(), batch.document_ids)
    chosen, _ = _sides(counts)
    return torch.stack([(chosen > 0).sum(), chosen.sum()])


def pair_record(sums: torch.Tensor, counts: torch.Tensor, dpo: DpoSection) -> dict:
    """The figures of `sums` (PAIR_FIGURES over all pairs, float64) and `counts` ([pairs,
    chosen tokens]): the mean loss over pairs, its rewards and accuracy, the chosen nll."""
    pairs, tokens = counts.double().clamp(min=1)
    nll = sums[1] / tokens
    loss = sums[0] / pairs + (dpo.nll_weight * nll if dpo.nll_weight else 0.0)
    return {
        "loss": loss,
        "nll": nll,
        "rewards/chosen": sums[2] / pairs,
        "rewards/rejected": sums[3] / pairs,
        "rewards/margins": (sums[2] - sums[3]) / pairs,
        "rewards/accuracy": sums[4] / pairs,
        "pairs": counts[0],
    }


def held_out_figures(
    out: CausalLMOutput, batch: Batch, reference: torch.Tensor, dpo: DpoSection
) -> torch.Tensor:
    """PAIR_FIGURES summed over a held-out micro-batch's pairs, then [pairs, chosen tokens]:
    [7] float64 (moetrain/loop/evaluation.py adds them over the ranks)."""
    stats = PairStats.of(token_logps(out.logits, batch.labels), reference, batch)
    return torch.cat([pair_sums(stats, dpo).detach(), pair_counts(batch).double()])


def held_out_record(total: torch.Tensor, dpo: DpoSection) -> dict:
    """The held-out pairs' figures (`held_out_figures` summed over all micro-batches), named
    as the evaluation logs them: eval_loss (the DPO loss), eval_rewards/..., eval_nll."""
    record = pair_record(total[:5], total[5:].long(), dpo)
    return {f"eval_{k}": float(v) if k != "pairs" else int(v) for k, v in record.items()}


def missing_sides(stats: PairStats) -> torch.Tensor:
    """How many sides of the pairs have no reference (NaN: a stored reference without the
    document), int64 on the device."""
    missing = stats.reference[0].isnan().long() + stats.reference[1].isnan().long()
    return (missing * stats.valid).sum()


class Reference:
    """The reference's log-probability sums of a micro-batch's documents, [B, W] float64
    (`per_document`): the model with its LoRA adapters off (the frozen base: no second copy;
    a model without adapters as it is), without gradient."""

    def __init__(self, model: nn.Module, terms: LossTerms, document_mask: bool) -> None:
        self.model, self.terms, self.document_mask = model, terms, document_mask

    def fill(self, *_run) -> list[str]:
        """Nothing to prepare before step 1 (`dpo.reference=stored` and `copy` have: their
        `fill` takes the trainer's model, terms, batches, state and resumed checkpoint)."""
        return []

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        with adapters_disabled(self.model):
            inputs = model_inputs(batch, self.terms, self.document_mask)
            out = self.model(batch.input_ids, batch.position_ids, **inputs)
        return per_document(token_logps(out.logits, batch.labels).double(), batch.document_ids)


class PreferenceLoss(StepLoss):
    """`StepLoss` for `train.objective=dpo` (see the module): `begin` counts the global
    batch's pairs and runs the reference over this rank's micro-batches; each forward's
    share is its pairs' losses over the global count; `end` adds the pair figures."""

    def __init__(
        self,
        terms: LossTerms,
        balance: BalanceTerms,
        scope: LossScope,
        dpo: DpoSection,
        reference: Callable[[Batch], torch.Tensor],
    ) -> None:
        super().__init__(terms, balance, scope)
        self.dpo, self.reference = dpo, reference

    def begin(self, micro_batches: list[Batch]) -> None:
        super().begin(micro_batches)
        counts = torch.stack([pair_counts(mb) for mb in micro_batches]).sum(0)
        if dist.get_world_size(self.scope.batch_group) > 1:
            dist.all_reduce(counts, group=self.scope.batch_group)
        self.pair_counts = counts
        self._pair_divisors = counts.clamp(min=1).double()
        self._references = [self.reference(mb) for mb in micro_batches]
        self._pair_sums: torch.Tensor | None = None

    def __call__(self, out: CausalLMOutput, batch: Batch) -> torch.Tensor:
        reference = self._references.pop(0)  # this micro-batch's, in the step's order
        stats = PairStats.of(token_logps(out.logits, batch.labels), reference, batch)
        sums = pair_sums(stats, self.dpo)
        loss = sums[0] / self._pair_divisors[0]
        if self.dpo.nll_weight:
            loss = loss + self.dpo.nll_weight * sums[1] / self._pair_divisors[1]
        sums = torch.cat([sums.detach(), missing_sides(stats).double()[None]])
        self._pair_sums = sums if self._pair_sums is None else self._pair_sums + sums
        if out.router_stats is not None:
            loss = loss + self.router_loss(out.router_stats)
        return loss

    def end(self) -> dict:
        record = super().end()
        sums = self._pair_sums
        if sums is None:
            sums = torch.zeros(len(PAIR_FIGURES) + 1, dtype=torch.float64, device=self.device)
        if dist.get_world_size() > 1:  # every rank holds distinct pairs
            dist.all_reduce(sums)
        record.update(pair_record(sums[:-1], self.pair_counts, self.dpo))
        record["reference_missing"] = sums[-1]  # sides without a reference (trainer refuses)
        return record


def step_loss(
    objective: str,
    dpo: DpoSection,
    terms: LossTerms,
    balance: BalanceTerms,
    scope: LossScope,
    reference: Callable[[Batch], torch.Tensor],
) -> StepLoss:
    """The step's loss for `train.objective`."""
    if objective == "dpo":
        return PreferenceLoss(terms, balance, scope, dpo, reference)
    return StepLoss(terms, balance, scope)
