"""What the trainer does differently under pipeline stages (`parallel.pp` > 1): the
schedule that runs a step's micro-batches through this rank's stages, the last stage's
loss, the embedding copy a head may need, the held-out loss forward only, and the
whole model's expert load. A mixin of `trainer.loop.trainer.Trainer`
(parallelisms/pipeline.py has the stages themselves)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from models.common.plan import ParallelPlan
from models.spec import LossTerms
from parallelisms.dims import stage_rank
from parallelisms.mesh import Meshes
from parallelisms.parallelize import Parallelized
from parallelisms.pipeline import Pipeline, SharedEmbedding
from parallelisms.pipeline_forward import ForwardOnly
from parallelisms.plan import match_modules
from trainer.config import JobConfig
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.loop.evaluation import token_loss_sum64
from trainer.loop.losses import model_inputs


class PipelinedSteps:
    """Needs the Trainer's cfg, dims, meshes, spec, parallel, params, terms, step_loss,
    grad_accum, device and rank."""

    def _build_pipeline(self) -> None:
        """The schedule over this rank's stages (none without pipeline stages), and which
        parameters the gradient norm counts: each once, not a stage's copy."""
        cfg = self.cfg
        self.pipeline, self.shared_embedding = None, None
        # the held-out loss of a source's micro-batches through the stages (trainer.loop.evaluation)
        self.forward_only = pipeline_evaluation(
            cfg, self.parallel, self.meshes, self.device, self.terms
        )
        if self.meshes.pp is not None:
            self.pipeline = Pipeline(
                self.parallel.stages,
                self.parallel.stage_indices,
                self.parallel.num_stages,
                cfg.parallel.pp_schedule,
                self.grad_accum,
                self.meshes.pp.get_group(),
                self.device,
                self.parallel.stage_metas,
                self._pipeline_loss,
            )
            self.pipeline.set_router_loss(self.step_loss.router_loss)
            if cfg.parallel.ep_overlap != "none":  # DualPipeV: forward and backward at once
                self.pipeline.overlap_expert_transfers(self.parallel.dispatchers)
            self.shared_embedding = self._shared_embedding()
        # What the gradient norm counts: each parameter once (not a stage's copy).
        copies = self.shared_embedding.copies if self.shared_embedding else set()
        self.norm_params = [p for p in self.params if id(p) not in copies]

    def _shared_embedding(self) -> SharedEmbedding | None:
        """The embedding copies of the first and last stage, when the head reads it."""
        if not self.parallel.embedding_on_last:
            return None
        pp, mine = self.dims.pp, None
        names = embedding_names(self.parallel.whole, self.spec.plan)
        if stage_rank(self.parallel.num_stages - 1, pp, self.cfg.parallel.pp_schedule) == 0:
            return SharedEmbedding(self.parallel.stages, names, None)  # both on each pp rank 0
        # NOTE: every rank creates every pair's group, in the same order (torch requires it);
        # rank = pp index * stage ranks + place in the batch (pp is the outermost degree).
        stage_ranks = self.dims.stage_ranks
        for place in range(stage_ranks):
            pair = [place, (pp - 1) * stage_ranks + place]
            group = dist.new_group(pair)
            if self.rank in pair:
                mine = group
        if mine is None:  # a middle stage holds neither copy
            return None
        return SharedEmbedding(self.parallel.stages, names, mine)

    def _moe_layers(self) -> int:
        """The whole model's MoE layers (one routed-experts module each)."""
        plan = self.spec.plan
        if plan.routed_experts is None:
            return 0
        return len(match_modules(self.parallel.whole, plan.routed_experts, "routed_experts"))

    def _pipeline_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: output = logits [B, S, V] (with MTP a
        tuple with each depth's); target = labels [B, S] (with MTP [B, S, 1 + D]: the
        labels, then each depth's)."""
        logits, *mtp_logits = output if isinstance(output, tuple) else (output,)
        if self.terms.mtp_depth:
            labels, mtp_labels = target[..., 0], target[..., 1:]
        else:
            labels, mtp_labels = target, None
        return self.step_loss.output_loss(logits, mtp_logits or None, labels, mtp_labels)

    def _pipeline_step(self, micro_batches: list[Batch]) -> None:
        """The step's micro-batches through the pipeline schedule, stacked on dim 0."""
        ids, kwargs, labels = stacked(micro_batches, self.terms, self.cfg.data.document_mask)
        target = labels
        if self.terms.mtp_depth:
            mtp_labels = torch.cat([mb.mtp_labels for mb in micro_batches])
            target = torch.cat([labels[..., None], mtp_labels], dim=-1)
        self.pipeline.step(ids, target, **kwargs)
        if self.shared_embedding is not None:
            self.shared_embedding.reduce_grads()

    def _whole_model_load(self) -> torch.Tensor | None:
        """The step's expert load of every pipeline stage ([L, E], this rank's data)."""
        mine = {k: v.cpu() for k, v in self.step_loss.stage_loads.items()}
        every: list[dict | None] = [None] * self.dims.pp
        dist.all_gather_object(every, mine, group=self.meshes.pp.get_group())
        loads = {k: v for part in every for k, v in part.items()}
        return torch.cat([loads[k] for k in sorted(loads)]) if loads else None


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


def pipeline_evaluation(
    cfg: JobConfig, parallel: Parallelized, meshes: Meshes, device: torch.device, terms: LossTerms
) -> Callable[[list[Batch]], torch.Tensor] | None:
    """Under pipeline stages (None without): what `Evaluator` runs a source's held-out
    micro-batches with, forward only through the stages (parallelisms/pipeline_forward.py):
    this rank's [cross-entropy sum, tokens] (float64), counted on the last stage's ranks
    alone (zeros on the others)."""
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

    def run(micro_batches: list[Batch]) -> torch.Tensor:
        ids, kwargs, labels = stacked(micro_batches, terms, cfg.data.document_mask)
        losses = forward(ids, labels, len(micro_batches), _eval_loss, **kwargs)
        total = torch.zeros(2, dtype=torch.float64)
        if forward.has_last:
            total[0] = sum(loss.cpu() for loss in losses)
            total[1] = (labels != IGNORE_INDEX).sum().cpu()
        return total

    return run


def _eval_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's held-out loss of one micro-batch: its float64 cross-entropy sum."""
    logits = output[0] if isinstance(output, tuple) else output
    return token_loss_sum64(logits, labels)
