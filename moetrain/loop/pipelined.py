"""What the trainer does differently under pipeline stages (`parallel.pp` > 1): the
schedule that runs a step's micro-batches through this rank's stages (`PipelinedStep`),
the last stage's loss, the embedding copy a head may need, the held-out loss forward only,
and the whole model's expert load (moetrain/parallelisms/pipeline.py has the stages themselves)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from moetrain.build.lora import adapters_disabled
from moetrain.config import JobConfig
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.loop.evaluation import token_loss_sum64
from moetrain.loop.losses import StepLoss, model_inputs
from moetrain.loop.preference import token_logps
from moetrain.models.common.plan import ParallelPlan
from moetrain.models.spec import LossTerms
from moetrain.parallelisms.dims import ParallelDims, stage_rank
from moetrain.parallelisms.mesh import Meshes
from moetrain.parallelisms.parallelize import Parallelized
from moetrain.parallelisms.pipeline import Pipeline, SharedEmbedding
from moetrain.parallelisms.pipeline_forward import ForwardOnly
from moetrain.parallelisms.plan import match_modules


def moe_layers(whole: nn.Module, plan: ParallelPlan) -> int:
    """The whole model's MoE layers (one routed-experts module each)."""
    if plan.routed_experts is None:
        return 0
    return len(match_modules(whole, plan.routed_experts, "routed_experts"))


def shared_embedding(
    parallel: Parallelized, dims: ParallelDims, plan: ParallelPlan, schedule: str, rank: int
) -> SharedEmbedding | None:
    """Under pipeline stages, the embedding copies of the first and last stage, when the
    head reads it (None on a middle stage, which holds neither copy)."""
    if not parallel.embedding_on_last:
        return None
    pp, mine = dims.pp, None
    names = embedding_names(parallel.whole, plan)
    if stage_rank(parallel.num_stages - 1, pp, schedule) == 0:
        return SharedEmbedding(parallel.stages, names, None)  # both on each pp rank 0
    # NOTE: every rank creates every pair's group, in the same order (torch requires it);
    # rank = pp index * stage ranks + place in the batch (pp is the outermost degree).
    stage_ranks = dims.stage_ranks
    for place in range(stage_ranks):
        pair = [place, (pp - 1) * stage_ranks + place]
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    if mine is None:  # a middle stage holds neither copy
        return None
    return SharedEmbedding(parallel.stages, names, mine)


class PipelinedStep:
    """A step's micro-batches through the pipeline schedule over this rank's stages."""

    def __init__(
        self,
        parallel: Parallelized,
        meshes: Meshes,
        step_loss: StepLoss,
        shared: SharedEmbedding | None,
        schedule: str,
        ep_overlap: bool,
        grad_accum: int,
        device: torch.device,
        terms: LossTerms,
        document_mask: bool,
    ) -> None:
        """`parallel`: this rank's stages (`build_model`); `meshes.pp`: the stages' group;
        `step_loss`: the step's loss, which the last stage computes; `shared`: the
        embedding copies whose gradients are summed after the schedule (`shared_embedding`);
        `schedule`: parallel.pp_schedule; `ep_overlap`: overlap the expert transfers of a
        forward and a backward (DualPipeV)."""
        self.terms, self.document_mask = terms, document_mask
        self.step_loss, self.shared = step_loss, shared
        self.pp_group = meshes.pp.get_group()
        self.pipeline = Pipeline(
            parallel.stages,
            parallel.stage_indices,
            parallel.num_stages,
            schedule,
            grad_accum,
            self.pp_group,
            device,
            parallel.stage_metas,
            self._loss,
        )
        self.pipeline.set_router_loss(step_loss.router_loss)
        if ep_overlap:  # DualPipeV: forward and backward at once
            self.pipeline.overlap_expert_transfers(parallel.dispatchers)

    def _loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: output = logits [B, S, V] (with MTP a
        tuple with each depth's); target = labels [B, S] (with MTP [B, S, 1 + D]: the
        labels, then each depth's)."""
        logits, *mtp_logits = output if isinstance(output, tuple) else (output,)
        if self.terms.mtp_depth:
            labels, mtp_labels = target[..., 0], target[..., 1:]
        else:
            labels, mtp_labels = target, None
        return self.step_loss.output_loss(logits, mtp_logits or None, labels, mtp_labels)

    def step(self, micro_batches: list[Batch]) -> None:
        """The step's micro-batches through the pipeline schedule, stacked on dim 0."""
        ids, kwargs, labels = stacked(micro_batches, self.terms, self.document_mask)
        target = labels
        if self.terms.mtp_depth:
            mtp_labels = torch.cat([mb.mtp_labels for mb in micro_batches])
            target = torch.cat([labels[..., None], mtp_labels], dim=-1)
        self.pipeline.step(ids, target, **kwargs)
        if self.shared is not None:
            self.shared.reduce_grads()

    def whole_model_load(self) -> torch.Tensor | None:
        """The step's expert load of every pipeline stage ([L, E], this rank's data)."""
        mine = {k: v.cpu() for k, v in self.step_loss.stage_loads.items()}
        every: list[dict | None] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(every, mine, group=self.pp_group)
        loads = {k: v for part in every for k, v in part.items()}
        return torch.cat([loads[k] for k in sorted(loads)]) if loads else None


def build_pipelined(
    cfg: JobConfig,
    parallel: Parallelized,
    meshes: Meshes,
    dims: ParallelDims,
    plan: ParallelPlan,
    rank: int,
    step_loss: StepLoss,
    grad_accum: int,
    device: torch.device,
    terms: LossTerms,
) -> tuple[PipelinedStep | None, SharedEmbedding | None]:
    """Under pipeline stages, the step through their schedule and the embedding copies a
    head may read ((None, None) without pipeline stages)."""
    if meshes.pp is None:
        return None, None
    p = cfg.parallel
    shared = shared_embedding(parallel, dims, plan, p.pp_schedule, rank)
    pipelined = PipelinedStep(
        parallel,
        meshes,
        step_loss,
        shared,
        p.pp_schedule,
        p.ep_overlap != "none",
        grad_accum,
        device,
        terms,
        cfg.data.document_mask,
    )
    return pipelined, shared


def embedding_names(whole: nn.Module, plan: ParallelPlan) -> set[str]:
    """The embedding's parameter names in the whole model (a head may read them)."""
    return {
        f"{fqn}.{name}"
        for fqn, module in match_modules(whole, plan.embedding, "embedding")
        for name, _ in module.named_parameters()
    }


def stacked(
    micro_batches: list[Batch], terms: LossTerms, document_mask: bool
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(input_ids, keyword inputs, labels) of `micro_batches`, stacked on dim 0."""

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(mb, name) for mb in micro_batches])

    inputs = model_inputs(micro_batches[0], terms, document_mask)
    kwargs = {key: cat(key) for key in ("position_ids", *inputs)}
    return cat("input_ids"), kwargs, cat("labels")


class StagedEvaluation:
    """Forward only through this rank's stages (moetrain/parallelisms/pipeline_forward.py):
    what `Evaluator` runs held-out micro-batches with (`StagedForward`), and the DPO
    reference's log-probabilities in training (`logps`, a `Logps`)."""

    def __init__(
        self, forward: ForwardOnly, model: nn.Module, terms: LossTerms, document_mask: bool
    ) -> None:
        """`model`: this rank's stages as one module (their LoRA adapters)."""
        self.forward, self.model = forward, model
        self.terms, self.document_mask = terms, document_mask

    def __call__(self, micro_batches: list[Batch]) -> torch.Tensor:
        """This rank's [cross-entropy sum, tokens] (float64), counted on the last stage's
        ranks alone (zeros on the others)."""
        ids, kwargs, labels = stacked(micro_batches, self.terms, self.document_mask)
        losses = self.forward(ids, labels, len(micro_batches), _eval_loss, **kwargs)
        total = torch.zeros(2, dtype=torch.float64)
        if self.forward.has_last:
            total[0] = sum(loss.cpu() for loss in losses)
            total[1] = (labels != IGNORE_INDEX).sum().cpu()
        return total

    def logps(self, micro_batches: list[Batch], adapters_off: bool) -> list[torch.Tensor]:
        """Each micro-batch's per-position log-probabilities on the last stage's ranks (none
        on the others); `adapters_off`: every stage of every rank runs its frozen base (each
        rank turns off its own stages' adapters), the reference of train.objective=dpo."""
        ids, kwargs, labels = stacked(micro_batches, self.terms, self.document_mask)
        with adapters_disabled(self.model) if adapters_off else contextlib.nullcontext():
            return self.forward(ids, labels, len(micro_batches), _logps, **kwargs)


def pipeline_evaluation(
    cfg: JobConfig,
    parallel: Parallelized,
    meshes: Meshes,
    device: torch.device,
    terms: LossTerms,
    model: nn.Module,
) -> StagedEvaluation | None:
    """Under pipeline stages (None without): the stages forward only (`StagedEvaluation`);
    `model`: this rank's stages as one module."""
    if meshes.pp is None:
        return None
    forward = ForwardOnly(
        parallel.stages,
        parallel.stage_indices,
        parallel.num_stages,
        cfg.parallel.pp_schedule,
        meshes.pp.get_group(),
        device,
        parallel.stage_metas,
    )
    return StagedEvaluation(forward, model, terms, cfg.data.document_mask)


def _eval_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's held-out loss of one micro-batch: its float64 cross-entropy sum."""
    logits = output[0] if isinstance(output, tuple) else output
    return token_loss_sum64(logits, labels)


def _logps(output, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's per-position log-probabilities of one micro-batch."""
    return token_logps(output[0] if isinstance(output, tuple) else output, labels)
