"""Aux-loss-free load balancing (DeepSeek-V3 report, §2.1.2).

Each router with a correction bias (`models.common.moe.GroupLimitedRouter`) counts the
assignments of its training forwards in its `tokens_per_expert` buffer, once per forward
(activation checkpointing's replays are not counted: `models.common.replay`). Just before each
optimizer update, an optimizer pre-step hook sums those counts over every rank (the whole
global batch: all data, context and expert-parallel ranks, all micro-batches) and moves
each bias by a fixed step against the load:

    bias_e += rate * sign(mean_e(load) - load_e)

then clears the counts. The counts are integers summed exactly, so every layout and every
gradient-accumulation split gives the same bias.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe import GroupLimitedRouter


class BiasUpdate:
    """The optimizer pre-step hook; `last_load` ([L, E] int64) is the load it last used."""

    def __init__(
        self, routers: list[GroupLimitedRouter], rate: float, group: dist.ProcessGroup | None = None
    ) -> None:
        for router in routers:
            if router.e_score_correction_bias.dtype != torch.float32:
                # NOTE: in bf16 a 1e-3 step vanishes next to biases of order 0.1-1.
                raise ValueError("the routing bias must stay fp32 (do not cast buffers to bf16)")
        self.routers = routers
        self.rate = rate
        self.group = group
        self.last_load: torch.Tensor | None = None
        # The device guard's verdict of the step whose update runs next (trainer.loop.step):
        # a skipped step moves no bias, without the host reading the verdict.
        self.skip: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, _optimizer: Any = None, _args: Any = None, _kwargs: Any = None) -> None:
        load = torch.stack([r.tokens_per_expert for r in self.routers])  # [L, E] int64
        if self.rate == 0:  # frozen bias: only clear the counts
            for router in self.routers:
                router.tokens_per_expert.zero_()
            return
        if dist.is_initialized():
            dist.all_reduce(load, group=self.group)  # the global batch's assignments
        step = self.rate * torch.sign(load.double().mean(-1, keepdim=True) - load.double())
        if self.skip is not None:
            step = torch.where(self.skip, 0.0, step)
        for router, delta in zip(self.routers, step):
            router.e_score_correction_bias.add_(delta.to(router.e_score_correction_bias.dtype))
            router.tokens_per_expert.zero_()
        self.last_load = load

    @torch.no_grad()
    def discard(self) -> None:
        """Forget the counts of a step that is not applied (`trainer.loop.guard`): the bias
        moves only with an update, so a skipped step leaves it as it was."""
        for router in self.routers:
            router.tokens_per_expert.zero_()


def attach_bias_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rate: float,
    group: dist.ProcessGroup | None = None,
) -> BiasUpdate | None:
    """Register the bias update on `optimizer` for every bias router of `model`; None when
    the model has none. `optimizer` None (this rank trains no parameter): the caller runs
    the update where the optimizer step would be."""
    routers = [m for m in model.modules() if isinstance(m, GroupLimitedRouter)]
    if not routers:
        return None
    update = BiasUpdate(routers, rate, group)
    if optimizer is not None:
        optimizer.register_step_pre_hook(update)
    return update
