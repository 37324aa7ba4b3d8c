"""The training loss of one step, composed from the model's outputs and global counts.

Every piece is a share (docs/overview.md, "Principles"), so that summed over forwards and ranks it is the value
one device would compute on the whole global batch. Token cross-entropy sums are divided
by the number of valid labels in the global batch (all ranks, all micro-batches); each MTP
depth by its own count; the router z-loss by the number of tokens routed in the global
batch; the load-balancing loss is split by `moe.aux_loss_mode`. Gradients
are then those of one device, for any layout and any accumulation count.

What the loss contains is the model's to say (`moetrain.models.LossTerms`: aux coefficient, MTP
depth and weight); nothing here knows a hyper-parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.models.common.balance_losses import (
    assignment_counts,
    load_balancing_loss,
    sequence_balance_loss,
    z_loss_sum,
)
from moetrain.models.common.moe import RouterStats
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.spec import LossTerms
from moetrain.parallelisms.dims import ParallelDims


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies (fp32) of logits [B, S, V] against labels [B, S]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def with_mtp_targets(batch: Batch, depth: int) -> Batch:
    """Multi-token prediction inputs and labels, [B, S, depth] each: at position i, depth k
    (1-based) reads token i+k and predicts token i+k+1, i.e. input_ids and labels shifted
    left by k; the last k positions have no target.

    NOTE: built on whole sequences, before any context-parallel split, so that a rank
    holding positions i gets tokens i+k that may live on another rank's part.
    """
    ids, labels = batch.input_ids, batch.labels  # [B, S]
    shifted_ids = [F.pad(ids[:, k:], (0, k), value=0) for k in range(1, depth + 1)]
    shifted_labels = [F.pad(labels[:, k:], (0, k), value=IGNORE_INDEX) for k in range(1, depth + 1)]
    return Batch(
        input_ids=ids,
        labels=labels,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        mtp_input_ids=torch.stack(shifted_ids, dim=-1),
        mtp_labels=torch.stack(shifted_labels, dim=-1),
    )


def model_inputs(
    batch: Batch, terms: LossTerms, document_mask: bool = False
) -> dict[str, torch.Tensor]:
    """Keyword inputs beyond (input_ids, position_ids): the MTP inputs the model's loss terms
    need, and the document ids when attention keeps to each document (`data.document_mask`).
    """
    inputs = {"mtp_input_ids": batch.mtp_input_ids} if terms.mtp_depth else {}
    if document_mask:
        inputs["document_ids"] = batch.document_ids
    return inputs


@dataclass(frozen=True)
class LossScope:
    """What one rank's share of a step's loss is a share of: the layout's degrees, the groups
    its statistics are summed over, the global batch and this rank's micro-batches of it."""

    dims: ParallelDims
    cp_group: dist.ProcessGroup | None  # the ranks holding parts of one sequence
    global_batch_size: int
    rounds: int  # micro-batches a step on this rank
    device: torch.device
    batch_group: dist.ProcessGroup | None = None  # holding the global batch; None: the world
    # The whole model's MoE layers, when a forward's statistics cover only some of them (a
    # pipeline stage's): the aux and z losses average over the layers, so a stage adds its
    # layers' part of that mean. 0: every forward covers all of them.
    moe_layers: int = 0


def aux_loss_share(
    stats: RouterStats, mode: str, scope: LossScope, pooled: bool = False
) -> torch.Tensor:
    """This forward's share of the step's aux loss (`moe.aux_loss_mode`), each MoE layer's
    loss averaged over the layers, or pooled over them (`moe.aux_loss_layers`).

    micro_batch: the Switch loss on one forward's sequences; global_batch: on those of all
    data-parallel ranks' forwards of the same accumulation round (`rounds` per step), as one
    device running their union; the step's value is the mean over forwards. sequence: the
    sequence-wise loss, mean over the global batch's sequences. Statistics spread over
    several ranks (the cp ranks of a sequence, or the whole batch) have their assignment
    counts all-reduced, and each rank adds its share (the losses are linear in the router
    probabilities and the counts carry no gradient).
    """
    _, batch, num_experts = stats.prob_sum.shape  # [L, B, E]
    dims, cp_group, rounds = scope.dims, scope.cp_group, scope.rounds
    cp = dims.cp
    if mode == "sequence":
        counts = assignment_counts(stats, pooled)
        if cp > 1:  # a sequence's counts over the cp ranks holding its parts
            counts = counts.clone()
            dist.all_reduce(counts, group=cp_group)
        seq_tokens = stats.seq_len * cp
        return sequence_balance_loss(stats, counts, seq_tokens, pooled) / scope.global_batch_size
    if mode == "global_batch":  # the whole batch: every rank of this pipeline stage
        group, ranks, forwards = scope.batch_group, dims.stage_ranks, rounds
    else:
        group, ranks, forwards = cp_group, cp, rounds * dims.dp_size
    if ranks == 1:
        aux = load_balancing_loss(stats, num_experts, pooled=pooled)
    else:
        counts = assignment_counts(stats, pooled).sum(1)  # [L, E]
        dist.all_reduce(counts, group=group)
        rows = batch * stats.seq_len * ranks  # each layer's tokens over the ranks
        aux = load_balancing_loss(stats, num_experts, counts, rows, pooled)
    return aux / forwards if forwards > 1 else aux  # (a division by 1 costs two launches)


@dataclass(frozen=True)
class BalanceTerms:
    """The routers' losses the job config asks for (`[moe]`); their weights beside the
    model's aux coefficient (`LossTerms.aux_loss_coef`)."""

    mode: str = "micro_batch"  # moe.aux_loss_mode: the scope of the aux loss's statistics
    pooled: bool = False  # moe.aux_loss_layers == "pooled": Hugging Face's value
    z_loss_coef: float = 0.0  # moe.z_loss_coef

    @classmethod
    def of(cls, moe) -> BalanceTerms:
        """From the config's `[moe]` section."""
        return cls(moe.aux_loss_mode, moe.aux_loss_layers == "pooled", moe.z_loss_coef)


@dataclass(frozen=True)
class GlobalCounts:
    """Counts over the whole global batch (every rank, every micro-batch) of one step."""

    tokens: int  # valid labels: the divisor of the mean token loss
    inputs: int  # every input token, masked-in or not: what the step computes on
    # An order-independent checksum of the batch's tokens: equal between runs that train on
    # the same samples at this step, whatever the layout (logged as data_fingerprint).
    fingerprint: int
    mtp_tokens: list[int]  # valid labels of each MTP depth (its last k positions have none)


def global_counts(
    micro_batches: list[Batch],
    mtp_depth: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`GlobalCounts`' figures as an int64 tensor on the device, [tokens, inputs,
    fingerprint, *mtp_tokens]: one all-reduce over the ranks that hold the global batch,
    `group` (None: the world; fp32 counts are exact only to 2^24)."""
    local = None
    for mb in micro_batches:
        part = torch.stack(
            [
                (mb.labels != IGNORE_INDEX).sum(),
                # (a fill, not torch.tensor: that copies from the host, and waits for it)
                torch.full((), mb.input_ids.numel(), device=mb.input_ids.device),
                (mb.input_ids * (mb.position_ids + 1)).sum(),
                *((mb.mtp_labels != IGNORE_INDEX).sum((0, 1)) if mtp_depth else []),
            ]
        )
        local = part if local is None else local + part  # (not `sum`: its 0 + is a launch)
    counts = local.to(device, torch.int64)
    if dist.get_world_size(group) > 1:  # a group of one has nothing to add
        dist.all_reduce(counts, group=group)
    return counts  # read with the step's record, never inside the step


class StepLoss:
    """Composes the loss of each forward of one step and tallies what the step reports.

    Per step: `begin(micro_batches)` (the global counts), then for each forward
    `loss = step_loss(out, batch)` and its backward, then `end()` for the record: the
    global mean token loss, aux, z and MTP losses (all ranks agree) and this rank's expert
    load ([L, E], summed over its forwards).
    """

    def __init__(self, terms: LossTerms, balance: BalanceTerms, scope: LossScope) -> None:
        self.terms, self.balance, self.scope = terms, balance, scope
        self.device = scope.device
        self.counts: GlobalCounts | None = None

    def begin(self, micro_batches: list[Batch]) -> None:
        rounds = self.scope.rounds
        if len(micro_batches) != rounds:  # the aux-loss shares are scaled by it
            raise ValueError(f"expected {rounds} micro-batches, got {len(micro_batches)}")
        group = self.scope.batch_group
        counts = global_counts(micro_batches, self.terms.mtp_depth, self.device, group)
        self.start(counts)

    def start(self, counts: GlobalCounts | torch.Tensor) -> None:
        """Begin a step with its global counts (as `global_counts` gives them, or known: the
        dry-run planner's meta trace)."""
        if isinstance(counts, GlobalCounts):
            figures = [counts.tokens, counts.inputs, counts.fingerprint, *counts.mtp_tokens]
            counts = torch.tensor(figures, dtype=torch.int64, device=self.device)
        self.counts = counts  # int64 [3 + mtp depth], on the device
        # NOTE: divisors on the device: dividing by them queues no host read. max(, 1): a
        # global batch whose loss mask keeps no token (instruction data) has no token loss
        # at all, 0 and not 0/0; a sequence shorter than an MTP depth leaves it no label.
        self._divisors = counts.clamp(min=1)
        # [sum of token losses, sum of aux shares, sum over depths of mean MTP losses,
        #  sum of z-loss shares], None until a forward adds one (`_tally`); stacked by `end`.
        # NOTE: not a tensor added into by index: each `t[i] += v` costs four launches.
        self._sums: list[torch.Tensor | None] = [None] * 4
        # this rank's expert load per stage (one key without pipeline stages), [L_s, E] each
        self.stage_loads: dict[int, torch.Tensor] = {}

    def __call__(self, out: CausalLMOutput, batch: Batch) -> torch.Tensor:
        loss = self.output_loss(out.logits, out.mtp_logits, batch.labels, batch.mtp_labels)
        if out.router_stats is not None:
            loss = loss + self.router_loss(out.router_stats)
        return loss

    def output_loss(
        self,
        logits: torch.Tensor,
        mtp_logits: list[torch.Tensor] | None,
        labels: torch.Tensor,
        mtp_labels: torch.Tensor | None,
    ) -> torch.Tensor:
        """The token loss share of one forward (and its MTP depths'), from its logits."""
        divisors, terms = self._divisors, self.terms
        ce_sum = token_loss_sum(logits, labels)
        loss = ce_sum / divisors[0]  # the global token count (its aux loss still trains)
        self._tally(0, ce_sum)
        for k, logits_k in enumerate(mtp_logits or []):
            mtp_mean = token_loss_sum(logits_k, mtp_labels[..., k]) / divisors[3 + k]
            loss = loss + terms.mtp_weight / terms.mtp_depth * mtp_mean
            self._tally(2, mtp_mean)
        return loss

    def _tally(self, i: int, value: torch.Tensor) -> None:
        """Adds a forward's figure to the step's sum number `i` (see `start`)."""
        have, value = self._sums[i], value.detach()
        self._sums[i] = value if have is None else have + value

    def router_loss(self, stats: RouterStats, stage: int = 0) -> torch.Tensor:
        """The aux (and z) loss share of one forward's routing statistics [L, B, E] (of
        pipeline stage `stage`'s layers)."""
        balance, terms = self.balance, self.terms
        aux = aux_loss_share(stats, balance.mode, self.scope, balance.pooled)
        z = z_loss_sum(stats) / self.counts[1]  # every token routed, masked-in or not
        if self.scope.moe_layers:  # a stage's layers: their part of the mean over all layers
            part = len(stats.prob_sum) / self.scope.moe_layers
            aux, z = aux * part, z * part
        loss = terms.aux_loss_coef * aux
        if balance.z_loss_coef:
            loss = loss + balance.z_loss_coef * z
        self._tally(1, aux)
        self._tally(3, z)
        load = stats.tokens_per_expert.sum(1)  # [L, E]
        have = self.stage_loads.get(stage)
        self.stage_loads[stage] = load if have is None else have + load
        return loss

    def end(self) -> dict:
        """The step's record, its figures as tensors on the device (`read_record` reads
        them): no host read here."""
        zero = None  # one zero for the figures no forward of this rank added
        parts = []
        for value in self._sums:
            if value is None:
                zero = torch.zeros((), device=self.device) if zero is None else zero
            parts.append(zero if value is None else value)
        sums = torch.stack(parts)  # fp32, as the forwards' figures
        if dist.get_world_size() > 1:  # over the world: every rank holds a distinct part
            dist.all_reduce(sums)
        sums = sums.double()  # as the host read them: fp32 values, float64 arithmetic
        # NOTE: under pipeline stages, by the whole model: a stage may hold no MoE layer
        routed = bool(self.stage_loads) or self.scope.moe_layers > 0
        record = {
            # float64, as the host divided it: the guard judges this value
            "loss": sums[0] / self._divisors[0].double(),
            "aux_loss": sums[1] if routed else None,
            "z_loss": sums[3] if routed else None,
            "tokens": self.counts[0],  # in the loss (a loss mask may leave some out)
            "tokens_all": self.counts[1],  # computed on
            "data_fingerprint": self.counts[2],
            "expert_load": (
                torch.cat([self.stage_loads[k] for k in sorted(self.stage_loads)])
                if len(self.stage_loads) > 1
                else next(iter(self.stage_loads.values()), None)
            ),
        }
        if self.terms.mtp_depth:
            record["mtp_loss"] = sums[2] / self.terms.mtp_depth  # mean over depths
        return record
