"""Pipeline parallelism (`parallel.pp`) on `torch.distributed.pipelining`.

Each pp rank holds one or more stages (`moetrain.parallelisms.dims.stages_per_rank`). A stage is a
copy of the meta model pruned to its modules (`moetrain.parallelisms.pipeline_split`), wrapped in a
`StageModule` that runs the model's parts (moetrain/models/common/staged.py): the first stage
embeds, every stage runs its blocks, the last runs the head. The stage module adopts the
model's children under their own names, so it is the FSDP root of its stage and its
parameter names are the model's: checkpoints do not depend on the cut.

Losses stay shares of the global batch's loss (docs/parallelisms.md, "Loss and gradient
scale"): the last stage's loss function returns the token (and MTP) loss share of its
micro-batch; each stage's routers add their aux and z-loss shares through
`_AddLossGradient`, which leaves the forward unchanged and feeds d(loss)/d(share) = 1 into
the share when the backward reaches the stage's output. torch's schedules then call
backward on the token loss only, and every gradient is that of one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from moetrain.models.common.balance_losses import stack_stats
from moetrain.models.common.moe import RouterStats
from moetrain.models.common.staged import run_blocks

# (stats of a stage's MoE layers, the stage's index) -> the loss share they add
RouterLoss = Callable[[RouterStats, int], torch.Tensor]

SCHEDULE_CLASSES = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


class _AddLossGradient(torch.autograd.Function):
    """y = x in the forward; in the backward, x's gradient passes through and `loss` gets
    gradient 1, as if it had been added to the final loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return x.clone()  # NOTE: not a view: FSDP hooks the stage output for backward

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


class StageModule(nn.Module):
    """One pipeline stage of `model` (already pruned to it): hidden states in and out.

    The first stage takes input_ids [B, S], the others hidden states [B, S, hidden]; the
    last returns logits [B, S, V] (with MTP: a tuple with each depth's logits), the others
    hidden states. Keyword inputs reach every stage.
    """

    def __init__(
        self, model: nn.Module, blocks: list[str], index: int, first: bool, last: bool
    ) -> None:
        super().__init__()
        if next(model.parameters(recurse=False), None) is not None:
            raise ValueError("a staged model keeps its parameters in submodules")
        for name, child in model.named_children():
            self.add_module(name, child)  # the same modules: FQNs are the model's
        # NOTE: a plain list, not a registered module: the model's methods are how the
        # parts run, and registering the model again would prefix every name.
        self._parts = [model]
        self._blocks = [model.get_submodule(f) for f in blocks]
        self.index, self.first, self.last = index, first, last
        # None: the routers add no loss (forward only)
        self.router_loss: RouterLoss | None = None  # set by the trainer for training steps

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        model = self._parts[0]
        h = model.embed(x) if self.first else x
        extra = model.block_inputs(h, position_ids, document_ids)
        h, stats = run_blocks(self._blocks, h, extra)
        out: tuple[torch.Tensor, ...] = (h,)
        if self.last:
            head = model.head(h, extra, mtp_input_ids)
            stats += list(head.stats)
            out = (head.logits, *(head.mtp_logits or []))
        if stats and self.router_loss is not None:
            share = self.router_loss(stack_stats(stats), self.index)
            out = (_AddLossGradient.apply(out[0], share), *out[1:])
        return out[0] if len(out) == 1 else out

    def head_only(self, h: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The last stage's outputs for hidden states `h` after its blocks (its head alone:
        what its output looks like, on the meta device)."""
        model = self._parts[0]
        extra = model.block_inputs(h, inputs["position_ids"], inputs.get("document_ids"))
        head = model.head(h, extra, inputs.get("mtp_input_ids"))
        return (head.logits, *(head.mtp_logits or []))

    def reset_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """The model's init of tensor `name` (moetrain/models/spec.py `CausalLM.reset_parameter`)."""
        self._parts[0].reset_parameter(name, tensor, generator)


class LocalStages(nn.Module):
    """One module over a rank's stages, for what wants the rank's whole model (checkpoints,
    the optimizer, weight init): the stages' children under the model's names, block lists
    merged. It is never called: the schedule runs the stages."""

    def __init__(self, stages: list[StageModule], shared: tuple[str, ...] = ()) -> None:
        """`shared`: children both the first and the last stage hold (the embedding a
        head reads, `SharedEmbedding`): the first stage's is adopted."""
        super().__init__()
        self._stages = stages  # NOTE: a plain list: their children are registered below
        for stage in stages:
            self._adopt(stage, shared)
        # tensor name -> the stage that holds it (a shared copy: the first stage)
        self._owner: dict[str, StageModule] = {}
        for stage in reversed(stages):
            for name, _ in [*stage.named_parameters(), *stage.named_buffers()]:
                self._owner[name] = stage

    def _adopt(self, stage: StageModule, shared: tuple[str, ...]) -> None:
        for name, child in stage.named_children():
            if (
                stage.last
                and not stage.first
                and name in shared
                and any(s.first for s in self._stages)
            ):
                continue  # the first stage's copy stands for both
            have = getattr(self, name, None)
            if have is None:
                self.add_module(name, child)
            elif isinstance(have, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                merged = nn.ModuleDict(dict(have.named_children()))
                merged.update(dict(child.named_children()))
                setattr(self, name, merged)
            elif have is not child:
                raise ValueError(f"two stages of one rank both hold {name!r}")

    def reset_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        self._owner[name].reset_parameter(name, tensor, generator)


class SharedEmbedding:
    """The embedding's parameters when the last stage holds a copy (its head reads them:
    a tied output head, MTP depths that embed tokens); the two copies stay equal.

    Stages on two ranks: after each step's backward the copies' gradients are summed over
    `group` (the first stage's rank and the last's, at the same place in the batch), so
    both take the same update from the same state; the gradient norm counts the first
    stage's copy only (`copies`). Both stages on this rank (the V schedules): the copy's
    gradient is added to the first stage's and dropped; the optimizer holds the first
    stage's alone (`LocalStages` adopts it), and `sync` copies its values over the copy
    after every update and every load.
    """

    def __init__(self, stages: list[StageModule], names: set[str], group: Any) -> None:
        self.group = group

        def held(stage: StageModule) -> list[torch.Tensor]:
            return [p for n, p in stage.named_parameters() if n in names]

        first = [held(s) for s in stages if s.first]
        last = [held(s) for s in stages if s.last]
        self.pairs = list(zip(first[0], last[0], strict=True)) if first and last else []
        self.params = [] if self.pairs else (first or last or [[]])[0]
        self.copies = {id(p) for p in last[0]} if last else set()

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def reduce_grads(self) -> None:
        for kept, copy in self.pairs:
            if copy.grad is not None:
                if kept.grad is None:
                    kept.grad = copy.grad
                else:
                    self._local(kept.grad).add_(self._local(copy.grad))
                copy.grad = None
        for p in self.params:
            if p.grad is None:  # this copy had no use in the step: it adds zero
                p.grad = torch.zeros_like(p)
            dist.all_reduce(self._local(p.grad), group=self.group)

    @torch.no_grad()
    def sync(self) -> None:
        for kept, copy in self.pairs:
            self._local(copy).copy_(self._local(kept))


class _Stage(PipelineStage):
    """torch's stage, minus the first step's warm-up messages a rank would send to itself.

    NOTE: the V schedules (ZBVZeroBubble, DualPipeV) place the two middle stages on one
    rank. torch 2.11's schedules open every stage's links with a message to each neighbour
    at the first step, this rank included, and gloo has no link to a rank itself ("Pair is
    not connected"): every V schedule failed on CPU there. Activations between stages on
    one rank never take a message, so the warm-up to itself has nothing to open (torch
    2.13 no longer sends it)."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]


class Pipeline:
    """This rank's stages and the schedule that runs them for a step (the held-out loss runs
    them forward only: `moetrain.parallelisms.pipeline_forward`)."""

    def __init__(
        self,
        stages: list[StageModule],
        indices: list[int],
        num_stages: int,
        schedule: str,
        micro_batches: int,
        group: Any,
        device: torch.device,
        metas: dict[int, tuple[Any, Any]],
        loss_fn: Callable[..., torch.Tensor],
    ) -> None:
        """`metas`: stage index -> (example input, example output) on the meta device:
        static shapes, so no stage runs a trial forward at the first step."""
        self.stages, self.indices, self.num_stages = stages, indices, num_stages
        self.has_first = 0 in indices
        self.has_last = num_stages - 1 in indices
        self.schedule_name, self.group, self.device = schedule, group, device
        self.schedule = self._schedule(metas, micro_batches, loss_fn)

    def _schedule(self, metas: dict, micro_batches: int, loss_fn: Callable[..., torch.Tensor]):
        pipe_stages = [
            _Stage(
                stage,
                index,
                self.num_stages,
                self.device,
                input_args=metas[index][0],
                output_args=metas[index][1],
                group=self.group,
            )
            for stage, index in zip(self.stages, self.indices, strict=True)
        ]
        cls = SCHEDULE_CLASSES[self.schedule_name]
        single = self.schedule_name == "1F1B"
        # NOTE: scale_grads=False: the loss is already a share of the global batch's mean.
        return cls(
            pipe_stages[0] if single else pipe_stages,
            micro_batches,
            loss_fn=loss_fn,
            scale_grads=False,
        )

    def overlap_expert_transfers(self, dispatchers: list) -> None:
        """Under DualPipeV with expert parallelism, run each overlapped pair of a forward
        and a backward at once, their all-to-alls taking turns
        (moetrain/parallelisms/pipeline_overlap.py); other schedules, or no experts: nothing to do."""
        if self.schedule_name != "DualPipeV" or not dispatchers:
            return
        from torch.distributed.pipelining.schedules import OVERLAP_F_B

        from moetrain.parallelisms.pipeline_overlap import Lockstep, overlapped_forward_backward

        lockstep = Lockstep()
        for dispatcher in dispatchers:
            dispatcher.lockstep = lockstep
        self.schedule.register_custom_function(OVERLAP_F_B, overlapped_forward_backward(lockstep))

    def set_router_loss(self, router_loss: RouterLoss | None) -> None:
        for stage in self.stages:
            stage.router_loss = router_loss

    def step(
        self, input_ids: torch.Tensor, target: torch.Tensor, **inputs: torch.Tensor | None
    ) -> None:
        """Forward and backward of a step's micro-batches, stacked on dim 0 (the schedule
        splits them back): input_ids to the first stage, target to the last."""
        kwargs = {k: v for k, v in inputs.items() if v is not None}
        args = (input_ids,) if self.has_first else ()
        self.schedule.step(*args, target=target if self.has_last else None, **kwargs)
