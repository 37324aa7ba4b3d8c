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
batch for any data-parallel or expert-parallel layout ("One device's numbers"). Under context
parallelism each document's sums are completed over the cp ranks before the pair loss
(`whole_sequences`); under pipeline stages the last stage computes the loss and the
reference runs through the stages forward only (moetrain/loop/pipelined.py). The MoE aux
and z losses come from the policy's forward alone: the reference forward's router statistics
are dropped. The record adds what a user watches (TRL's names): rewards/chosen and
rewards/rejected (beta r, mean over pairs), rewards/margins, rewards/accuracy (the share of
pairs whose chosen reward is the higher), and nll (the chosen answers' mean cross-entropy).
A reference is NaN for a document it does not hold (a stored reference only): the step's
record counts those sides (`reference_missing`), and the trainer refuses the run at once.
"""

from __future__ import annotations

import contextlib
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
from moetrain.models.spec import LossTerms
from moetrain.parallelisms.context_parallel import ContextParallelAttention, use_cp_table

# The figures a step (or an evaluation) sums over its pairs, in this order.
PAIR_FIGURES = ("loss", "nll", "chosen", "rejected", "accuracy")


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) of each position (fp32) of logits [B, S, V]; 0 where there is no label."""
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -ce.view(labels.shape)


def per_document(values: torch.Tensor, document_ids: torch.Tensor, width: int) -> torch.Tensor:
    """values [B, S] summed by document of their sample: [B, W], W = `width` rounded up to
    even (at least the whole sequence's length: a sample holds at most that many documents,
    and under CP a rank's part of a sample keeps the whole sample's document ids), column d
    the sum over document d's positions."""
    width += width % 2
    sums = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device)
    return sums.scatter_add(1, document_ids, values)


def trained_tokens(batch: Batch, width: int) -> torch.Tensor:
    """Each document's trained tokens [B, W] (float64, exact) of this rank's part."""
    return per_document((batch.labels != IGNORE_INDEX).double(), batch.document_ids, width)


def logp_sums(logps: torch.Tensor, batch: Batch, width: int) -> torch.Tensor:
    """Each document's log-probability sum [B, W] of this rank's part (float64).

    NOTE: summed in float64: a side of a thousand tokens sums to thousands, where fp32
    keeps only ~1e-3 of the margin, a small difference of two such sums."""
    return per_document(logps.double(), batch.document_ids, width)


def whole_sequences(parts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-document sums [..., W] of this rank's parts of its sequences -> of the whole
    sequences: summed over the cp ranks `group` that hold their other parts (the input
    when there are none). With gradient, the value is the whole's and the gradient that of
    this rank's part: the pair loss L(S) is not linear in the sums S = sum over ranks of
    s_r, and each rank's backward then gives dL/dS * ds_r, which the gradient reduction
    over the cp ranks (a sum, as for every loss share) adds up to dL/dS * dS."""
    if group is None or dist.get_world_size(group) == 1:
        return parts
    whole = parts.detach().clone()
    dist.all_reduce(whole, group=group)
    if not parts.requires_grad:
        return whole
    return whole + (parts - parts.detach())  # (x - x is exactly 0: the value stays S)


@dataclass(frozen=True)
class PairStats:
    """Per pair slot [B, W / 2] of one micro-batch (slots without a pair: `valid` False)."""

    policy: tuple[torch.Tensor, torch.Tensor]  # log-probability sums: chosen, rejected
    reference: tuple[torch.Tensor, torch.Tensor]
    tokens: tuple[torch.Tensor, torch.Tensor]  # trained tokens of each side
    valid: torch.Tensor  # bool

    @staticmethod
    def of(policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor) -> PairStats:
        """From per-document sums [B, W] of whole sequences (`whole_sequences`): the
        policy's and the reference's log-probabilities, the trained tokens."""
        sides = _sides(tokens)
        return PairStats(_sides(policy), _sides(reference), sides, sides[0] > 0)


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


def pair_counts(tokens: torch.Tensor) -> torch.Tensor:
    """[pairs, chosen tokens] of one micro-batch, int64, from its documents' trained tokens
    [B, W] over whole sequences (`trained_tokens`, `whole_sequences`)."""
    chosen, _ = _sides(tokens)
    return torch.stack([(chosen > 0).sum(), chosen.sum().long()])


def counted_once(group: dist.ProcessGroup | None) -> bool:
    """Whether this rank adds a sequence's figures: its first cp rank (`group`) alone, as
    every cp rank holds the whole sequences' sums after `whole_sequences`."""
    return group is None or dist.get_rank(group) == 0


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
    policy: list[torch.Tensor],
    reference: list[torch.Tensor],
    micro_batches: list[Batch],
    dpo: DpoSection,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """PAIR_FIGURES summed over held-out micro-batches' pairs, then [pairs, chosen tokens]:
    [7] float64, from this rank's per-position log-probabilities of the policy and the
    reference's per-document sums of its parts (`document_width` wide) of each micro-batch
    (none: a pipeline rank without the last stage, zeros); each pair counted once over the
    cp ranks `cp_group` (moetrain/loop/evaluation.py adds the figures over the ranks)."""
    total = torch.zeros(len(PAIR_FIGURES) + 2, dtype=torch.float64)
    if not policy:
        return total
    width = document_width(micro_batches, cp_group)
    parts = torch.stack(
        [
            torch.stack([logp_sums(p, mb, width), r, trained_tokens(mb, width)])
            for p, r, mb in zip(policy, reference, micro_batches, strict=True)
        ]
    )  # [micro-batches, 3, B, W]
    whole = whole_sequences(parts, cp_group)
    if not counted_once(cp_group):
        return total
    for policy_sums, reference_sums, tokens in whole:
        stats = PairStats.of(policy_sums, reference_sums, tokens)
        total += torch.cat([pair_sums(stats, dpo), pair_counts(tokens).double()]).cpu()
    return total


def document_width(micro_batches: list[Batch], cp_group: dist.ProcessGroup | None) -> int:
    """The per-document sums' width of `micro_batches` (this rank's parts of their sequences
    under CP, `cp_group`): the whole sequences' length, as their document ids run to it."""
    ranks = 1 if cp_group is None else dist.get_world_size(cp_group)
    return micro_batches[0].labels.shape[1] * ranks


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


# this rank's per-position log-probabilities [B, S] (0 where untrained) of each of
# `micro_batches`, without gradient; `adapters_off`: the frozen base's. Empty on a pipeline
# rank without the last stage (moetrain/loop/pipelined.py `StagedEvaluation.logps`).
Logps = Callable[[list[Batch], bool], list[torch.Tensor]]
# What a `PreferenceLoss` and the evaluation take the reference from: each of `micro_batches`'
# per-document log-probability sums [B, W] float64 (W: `document_width`) of this rank's parts
# of its sequences; empty on a pipeline rank without the last stage. A `Reference`, or
# `dpo.reference=stored` / `copy` (moetrain/loop/stored_reference.py, reference_copy.py).
ReferenceSums = Callable[[list[Batch], int], list[torch.Tensor]]


class ModelLogps:
    """`Logps` of the model's forward on this rank (its parts of the sequences under CP)."""

    def __init__(self, model: nn.Module, terms: LossTerms, document_mask: bool) -> None:
        self.model, self.terms, self.document_mask = model, terms, document_mask
        self.rings = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]

    @torch.no_grad()
    def __call__(self, micro_batches: list[Batch], adapters_off: bool) -> list[torch.Tensor]:
        logps = []
        with adapters_disabled(self.model) if adapters_off else contextlib.nullcontext():
            for mb in micro_batches:
                if mb.cp_table is not None:  # cp_layout=balanced: this micro-batch's chunks
                    use_cp_table(self.rings, mb.cp_table)
                inputs = model_inputs(mb, self.terms, self.document_mask)
                out = self.model(mb.input_ids, mb.position_ids, **inputs)
                logps.append(token_logps(out.logits, mb.labels))
        return logps


class Reference:
    """`dpo.reference=base` (`ReferenceSums`): the model with its LoRA adapters off (the
    frozen base: no second copy; a model without adapters as it is), through `logps` (this
    rank's forward, or the pipeline stages' forward only)."""

    def __init__(self, logps: Logps) -> None:
        self.logps = logps

    def fill(self, *_run) -> list[str]:
        """Nothing to prepare before step 1 (`dpo.reference=stored` and `copy` have: their
        `fill` takes the trainer's model, terms, batches, state and resumed checkpoint)."""
        return []

    def __call__(self, micro_batches: list[Batch], width: int) -> list[torch.Tensor]:
        logps = self.logps(micro_batches, True)
        if not logps:  # a pipeline rank without the last stage
            return []
        return [logp_sums(lp, mb, width) for lp, mb in zip(logps, micro_batches, strict=True)]


class PreferenceLoss(StepLoss):
    """`StepLoss` for `train.objective=dpo` (see the module): `begin` runs the reference
    over this rank's micro-batches and counts the global batch's pairs; each forward's
    share is its pairs' losses over the global count; `end` adds the pair figures.

    Under CP each forward's per-document sums are completed over the cp ranks before the
    pair loss (`whole_sequences`), and a sequence's figures and pairs count on its first cp
    rank alone. Under pipeline stages the last stage computes the loss of each micro-batch
    (`output_loss`, as the schedule calls it: in the step's order) and the reference runs
    through the stages forward only; a stage's routers add their aux and z shares."""

    def __init__(
        self,
        terms: LossTerms,
        balance: BalanceTerms,
        scope: LossScope,
        dpo: DpoSection,
        reference: ReferenceSums,
    ) -> None:
        super().__init__(terms, balance, scope)
        self.dpo, self.reference = dpo, reference

    def begin(self, micro_batches: list[Batch]) -> None:
        super().begin(micro_batches)
        group = self.scope.cp_group
        self._width = document_width(micro_batches, group)
        parts = [torch.stack([trained_tokens(mb, self._width) for mb in micro_batches])]
        references = self.reference(micro_batches, self._width)  # the last stage's ranks
        if references:
            parts.append(torch.stack(references))
        whole = whole_sequences(torch.stack(parts), group)  # [1 or 2, micro-batches, B, W]
        tokens = whole[0]
        counts = torch.stack([pair_counts(t) for t in tokens]).sum(0)
        self._counted = counted_once(group)
        if not self._counted:
            counts = torch.zeros_like(counts)
        if dist.get_world_size(self.scope.batch_group) > 1:
            dist.all_reduce(counts, group=self.scope.batch_group)
        self.pair_counts = counts
        self._pair_divisors = counts.clamp(min=1).double()
        # per micro-batch, in the step's order: (its batch, its reference's sums, its tokens)
        reference = whole[1] if references else [None] * len(micro_batches)
        self._pending = list(zip(micro_batches, reference, tokens, strict=True))
        self._pair_sums: torch.Tensor | None = None

    def output_loss(
        self,
        logits: torch.Tensor,
        mtp_logits: list[torch.Tensor] | None,
        labels: torch.Tensor,
        mtp_labels: torch.Tensor | None,
    ) -> torch.Tensor:
        """The pair loss share of the step's next micro-batch (the last stage's, under
        pipeline stages), from its logits."""
        batch, reference, tokens = self._pending.pop(0)
        if labels.shape != batch.labels.shape:
            raise ValueError(f"micro-batch of {tuple(labels.shape)} labels, expected the next")
        parts = logp_sums(token_logps(logits, labels), batch, self._width)
        policy = whole_sequences(parts, self.scope.cp_group)
        stats = PairStats.of(policy, reference, tokens)
        sums = pair_sums(stats, self.dpo)
        loss = sums[0] / self._pair_divisors[0]
        if self.dpo.nll_weight:
            loss = loss + self.dpo.nll_weight * sums[1] / self._pair_divisors[1]
        if self._counted:
            sums = torch.cat([sums.detach(), missing_sides(stats).double()[None]])
            self._pair_sums = sums if self._pair_sums is None else self._pair_sums + sums
        return loss

    def end(self) -> dict:
        record = super().end()
        sums = self._pair_sums
        if sums is None:
            sums = torch.zeros(len(PAIR_FIGURES) + 1, dtype=torch.float64, device=self.device)
        if dist.get_world_size() > 1:  # every pair on one rank (its first cp rank)
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
    reference: ReferenceSums,
) -> StepLoss:
    """The step's loss for `train.objective`; `reference`: the DPO reference's sums."""
    if objective == "dpo":
        return PreferenceLoss(terms, balance, scope, dpo, reference)
    return StepLoss(terms, balance, scope)
