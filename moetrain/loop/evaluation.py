"""The held-out loss (`[eval]`): the same samples every round, on any layout.

Invariant: evaluation changes nothing of the training state. It runs under `torch.no_grad`
on the samples `moetrain.data.run_data` set aside (never the training sampler), draws no
random numbers, and the routers count only grad-enabled forwards, so parameters, optimizer
state, routing bias, data position and RNG are as before; the EP dispatchers' byte counts it
adds are dropped. A run with `eval.interval=1` trains bit for bit like one without.

Under `train.objective=dpo` the held-out data are pairs, and the figures those of training
(moetrain/loop/preference.py): eval_loss the DPO loss over the held-out pairs, with
eval_rewards/chosen, /rejected, /margins, /accuracy and eval_nll, the reference training's
(`dpo.reference`: the model with its adapters off, the stored sums of the first pass, or
the frozen copy): under CP each document's sums completed over the cp ranks, each pair
counted on the first of them; under pipeline stages both forwards through the stages
(`StagedForward.logps`).

Otherwise the loss is the token-weighted next-token cross-entropy over every held-out token: the sum
of the per-token losses over all ranks, divided by the global token count (one float64
all-reduce per round, per source). No aux or MTP term: it is the number to compare between
runs and checkpoints. Rank r of the data-parallel ranks takes the r-th contiguous share of
each source's samples; shares are padded to the same number of micro-batches with samples
whose labels count no token, so that every rank runs the same forwards (FSDP, EP and CP
need them) and the result does not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from moetrain.config.objective import DpoSection
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.data.run_data import HeldOut
from moetrain.errors import DataError
from moetrain.loop.losses import model_inputs, with_mtp_targets
from moetrain.loop.preference import (
    ModelLogps,
    Reference,
    ReferenceSums,
    document_width,
    held_out_figures,
    held_out_record,
)
from moetrain.models.spec import LossTerms
from moetrain.parallelisms.context_parallel import ContextParallelAttention, use_cp_table
from moetrain.parallelisms.cp_schedule import balanced_table, split_for_cp


def _share(samples: int, dp_rank: int, dp_size: int) -> range:
    per_rank = -(-samples // dp_size)
    return range(min(dp_rank * per_rank, samples), min((dp_rank + 1) * per_rank, samples))


def rank_micro_batches(
    dataset: Dataset, samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[Batch]:
    """This rank's micro-batches (CPU) of the first `samples` of `dataset`: its contiguous
    share, padded with samples that count no token to as many micro-batches as every other
    rank runs (FSDP, EP and CP need the same forwards on each)."""
    per_rank = -(-samples // dp_size)
    rounds = -(-per_rank // micro_batch_size)
    mine = _share(samples, dp_rank, dp_size)
    pad = _no_tokens(dataset[0])
    for r in range(rounds):
        at = range(mine.start + r * micro_batch_size, mine.start + (r + 1) * micro_batch_size)
        yield Batch.stack([dataset[i] if i in mine else pad for i in at])


class StagedForward(Protocol):
    """Under pipeline stages, what runs held-out micro-batches through them forward only
    (moetrain/loop/pipelined.py `pipeline_evaluation`)."""

    def __call__(self, micro_batches: list[Batch]) -> torch.Tensor:
        """This rank's [cross-entropy sum, tokens] (float64; zeros but on the last stage's
        ranks)."""

    def logps(self, micro_batches: list[Batch], adapters_off: bool) -> list[torch.Tensor]:
        """Each micro-batch's per-position log-probabilities (the last stage's ranks; none
        on the others), `adapters_off`: the reference's (moetrain/loop/preference.py)."""


class Evaluator:
    def __init__(
        self,
        held_out: list[HeldOut],
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        prepare: Callable[[Batch], Batch],
        terms: LossTerms,
        document_mask: bool,
        dpo: DpoSection | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`prepare`: a micro-batch as the model takes it on this rank (device, MTP inputs,
        this rank's part of each sequence under CP): the same path as training's. `dpo`:
        train.objective=dpo's section (held-out pairs); `cp_group`: the ranks holding the
        other parts of this rank's sequences (a pair's figures need the whole sequences)."""
        self.names = [h.name for h in held_out]
        self.prepare, self.terms, self.document_mask = prepare, terms, document_mask
        self.dpo, self.cp_group = dpo, cp_group
        # dpo.reference=stored or copy (moetrain.loop.stored_reference), set once filled;
        # None: the model with its adapters off
        self.reference: ReferenceSums | None = None
        self.batches = [  # per source: this rank's micro-batches (CPU)
            list(rank_micro_batches(h.dataset, h.samples, micro_batch_size, dp_rank, dp_size))
            for h in held_out
        ]

    def __call__(self, model: nn.Module, pipeline: StagedForward | None = None) -> dict[str, float]:
        """`pipeline`: under pipeline stages, what runs a source's micro-batches through
        them. In eval mode (no dropout: no random draws), then back as it was."""
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            return self._evaluate(model, pipeline)
        finally:
            for module, training in modes.items():
                module.train(training)

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, pipeline: StagedForward | None) -> dict[str, float]:
        if self.dpo is not None:
            return self._evaluate_pairs(model, pipeline)
        sums = []  # per source: [cross-entropy sum, tokens], float64
        rings = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
        for batches in self.batches:
            if pipeline is not None:
                sums.append(pipeline([self.prepare(mb) for mb in batches]))
                continue
            total = torch.zeros(2, dtype=torch.float64)
            for mb in batches:
                mb = self.prepare(mb)
                if mb.cp_table is not None:
                    use_cp_table(rings, mb.cp_table)
                out = model(
                    mb.input_ids,
                    mb.position_ids,
                    **model_inputs(mb, self.terms, self.document_mask),
                )
                total[0] += token_loss_sum64(out.logits, mb.labels).cpu()
                total[1] += (mb.labels != IGNORE_INDEX).sum().cpu()
            sums.append(total)
        device = next(model.parameters()).device
        sums = torch.stack(sums).to(device)  # [sources, 2]
        dist.all_reduce(sums)  # every rank holds distinct tokens (data- and cp-parallel)
        sums = sums.cpu()
        loss = float(sums[:, 0].sum() / sums[:, 1].sum())
        record = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}
        record["eval_tokens"] = int(sums[:, 1].sum())
        if len(self.names) > 1:
            for name, (ce, tokens) in zip(self.names, sums.tolist(), strict=True):
                record[f"eval_loss/{name}"] = ce / tokens
        return record

    def _evaluate_pairs(self, model: nn.Module, pipeline: StagedForward | None) -> dict:
        """The held-out pairs' DPO figures (one source: blends are refused with DPO)."""
        logps = (
            pipeline.logps
            if pipeline is not None
            else ModelLogps(model, self.terms, self.document_mask)
        )
        batches = [self.prepare(mb) for mb in self.batches[0]]
        reference = self.reference or Reference(logps)
        references = reference(batches, document_width(batches, self.cp_group))
        policy = logps(batches, False)
        total = held_out_figures(policy, references, batches, self.dpo, self.cp_group)
        device = next(model.parameters()).device
        total = total.to(device)
        dist.all_reduce(total)  # every pair on one rank (the first of its cp ranks)
        if total.isnan().any():  # a held-out side the stored reference lacks
            raise DataError(
                "the held-out pairs hold a document the stored DPO reference has not: it was "
                "computed for other [eval] data; evaluate with the [eval] keys of the run's start"
            )
        return held_out_record(total.cpu(), self.dpo)


def token_loss_sum64(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the per-token cross-entropies (fp32) of logits [B, S, V]."""
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce.double().sum()


def _no_tokens(sample: Batch) -> Batch:
    """A sample that runs through the model like any other but counts no token."""
    return Batch(
        input_ids=sample.input_ids,
        labels=torch.full_like(sample.labels, IGNORE_INDEX),
        position_ids=sample.position_ids,
        document_ids=sample.document_ids,
    )


def batch_preparer(
    device: torch.device, mtp_depth: int, cp: int, cp_rank: int, layout: str
) -> Callable[[Batch], Batch]:
    """What the training loop does to a loaded micro-batch before the model sees it.
    `layout`: `parallel.cp_layout`; a balanced one's table comes with the batch (the rings
    read it: `moetrain.parallelisms.context_parallel.use_cp_table`)."""

    def prepare(batch: Batch) -> Batch:
        # NOTE: from the loader's host copy: the greedy fill reads the work on the host, and
        # after the copy to a GPU that would wait for it on every micro-batch
        balanced = cp > 1 and layout == "balanced"
        table = balanced_table(batch.document_ids, cp) if balanced else None
        batch = batch.to(device)
        if mtp_depth:  # before the cp split: depth k reads tokens k ahead
            batch = with_mtp_targets(batch, mtp_depth)
        if cp > 1:  # this rank's part of each sequence, true positions kept
            zigzag = layout == "zigzag"
            batch = batch.map(lambda t: split_for_cp(t, cp_rank, cp, zigzag, table))
            batch = replace(batch, cp_table=table)
        return batch

    return prepare
