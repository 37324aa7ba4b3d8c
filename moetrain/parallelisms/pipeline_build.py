"""From a meta model to this rank's pipeline stages: the cut, its checks, the stage modules
and their example shapes (`moetrain.parallelisms.pipeline`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from moetrain.models.common.plan import ParallelPlan
from moetrain.models.common.staged import default_positions
from moetrain.parallelisms.dims import LayoutError, stage_rank, stages_per_rank
from moetrain.parallelisms.pipeline import StageModule
from moetrain.parallelisms.pipeline_split import (
    balanced_split,
    check_split,
    prune_to_stage,
    rank_balanced_split,
    stage_block_names,
    stage_costs,
    trunk_blocks,
)
from moetrain.parallelisms.plan import match_modules


@dataclass(frozen=True)
class PipelineCut:
    """Which blocks each stage runs, and which stages this rank holds."""

    blocks: list[list[str]]  # per stage: its trunk blocks' FQNs
    schedule: str
    pp: int
    # The head reads the embedding (a tied output head, MTP depths that embed tokens): the
    # last stage holds a copy of it, its gradient summed with the first stage's
    # (`moetrain.parallelisms.pipeline.SharedEmbedding`).
    embedding_on_last: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def local(self, pp_rank: int) -> list[int]:
        """The stages `pp_rank` holds, in stage order."""
        return [
            s for s in range(self.num_stages) if stage_rank(s, self.pp, self.schedule) == pp_rank
        ]


def cut_pipeline(
    model: nn.Module,
    plan: ParallelPlan,
    parallel,
    attention_flops: float,
    mtp_depth: int,
    total_flops: float | None = None,
) -> PipelineCut:
    """The cut of `model` (meta, whole) for a config's [parallel] section: its
    `pp_layers`, or the split that balances the stages' FLOPs (`total_flops`: the spec's
    count, `stage_costs`); and whether its head needs the embedding on the last stage
    (tried on the meta device)."""
    stages = parallel.pp * stages_per_rank(parallel.pp_schedule, parallel.pp_virtual_stages)
    blocks = len(trunk_blocks(model, plan))
    if parallel.pp_layers:
        counts = list(parallel.pp_layers)
        check_split(counts, blocks, stages)
    else:
        costs = stage_costs(model, plan, attention_flops, total_flops)
        rank_of = [stage_rank(s, parallel.pp, parallel.pp_schedule) for s in range(stages)]
        # several stages a rank (interleaved, V): balance the ranks, which the pipeline waits on
        one_each = stages == parallel.pp
        counts = balanced_split(costs, stages) if one_each else rank_balanced_split(costs, rank_of)
    cut = PipelineCut(stage_block_names(model, plan, counts), parallel.pp_schedule, parallel.pp)
    # NOTE: MTP depths take token ids (moetrain/models/spec.py), so they embed them: by contract.
    _, h, kwargs = example_inputs(model, 1, 2, torch.float32)
    if not mtp_depth and _head_runs(stage_module(model, plan, cut, cut.num_stages - 1), h, kwargs):
        return cut
    cut = replace(cut, embedding_on_last=True)
    # with the embedding there, a head that still cannot run is refused
    last_stage_output(stage_module(model, plan, cut, cut.num_stages - 1), h, kwargs)
    return cut


def _head_runs(stage: StageModule, h: torch.Tensor, kwargs: dict) -> bool:
    try:
        last_stage_output(stage, h, kwargs)
    except LayoutError:
        return False
    return True


def stage_module(model: nn.Module, plan: ParallelPlan, cut: PipelineCut, index: int) -> StageModule:
    """Stage `index` of `model` (meta): a pruned copy, wrapped."""
    first, last = index == 0, index == cut.num_stages - 1
    # NOTE: the modules pruning drops are shared, not copied (the memo maps them to
    # themselves), then dropped from the copy's containers: a stage costs its own modules.
    keep = set(cut.blocks[index])
    dropped = [m for f, m in trunk_blocks(model, plan) if f not in keep]
    if not (first or (last and cut.embedding_on_last)):
        dropped += [m for _, m in match_modules(model, plan.embedding, "embedding", required=False)]
    if not last:
        dropped += [m for _, m in match_modules(model, plan.head, "head", required=False)]
    part = copy.deepcopy(model, {id(m): m for m in dropped})
    prune_to_stage(part, plan, cut.blocks[index], first, last, cut.embedding_on_last)
    return StageModule(part, cut.blocks[index], index, first, last)


def example_inputs(
    model: nn.Module, micro_batch: int, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Meta (input_ids, hidden states, keyword inputs) of one micro-batch on a rank:
    `seq_len` is this rank's part of a sequence, `dtype` the model's compute dtype. The
    keyword inputs are those the head's shapes need: the MTP inputs are left out (the
    MTP logits have the logits' shape, moetrain/models/spec.py)."""
    with torch.device("meta"):
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        # NOTE: hidden states carry gradients between stages even when the embedding is
        # frozen (LoRA): the receiving stage sends its input's gradient back.
        h = model.embed(ids).to(dtype).detach().requires_grad_()
        kwargs = {"position_ids": default_positions(ids)}
    return ids, h, kwargs


def last_stage_output(
    stage: StageModule,
    h: torch.Tensor,
    kwargs: dict,
    dtype: torch.dtype = torch.float32,
    mtp_depth: int = 0,
):
    """The last stage's output on the meta device (its head run on `h`: the blocks keep
    the shape of the hidden states; each MTP depth's logits that of the logits). A head
    that reads a module of another stage is refused here, before any rank builds."""
    try:
        with torch.device("meta"), torch.no_grad():
            out = stage.head_only(h, **kwargs)
    except (AttributeError, TypeError) as err:
        raise LayoutError(
            "parallel.pp: this model's head reads a module that is on no pipeline stage's "
            f"list ({err}); its plan's `head` must name every module the head uses, or use "
            "parallel.pp=1"
        ) from None
    logits = out[0].to(dtype)
    return (logits,) * (1 + mtp_depth) if mtp_depth else logits
