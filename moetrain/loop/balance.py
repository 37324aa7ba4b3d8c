"""Aux-loss-free load balancing (DeepSeek-V3 report, §2.1.2).

A router takes part by what it holds, not by its class: the two buffers the model's spec
names (`moetrain.models.spec.BiasBuffers`, by default `e_score_correction_bias` [E] fp32 and
`tokens_per_expert` [E] int64). The router counts the assignments of its training forwards
in the counts buffer, once per forward (activation checkpointing's replays are not counted:
`moetrain.models.common.replay`). Just before each optimizer update, an optimizer pre-step hook sums
those counts over every rank (the whole global batch: all data, context and
expert-parallel ranks, all micro-batches) and moves each bias by a fixed step against the
load:

    bias_e += rate * sign(mean_e(load) - load_e)

then clears the counts. The counts are integers summed exactly, so every layout and every
gradient-accumulation split gives the same bias.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.models.spec import BiasBuffers

# The names every model uses unless its spec says otherwise (`ModelSpec.bias_buffers`).
DEFAULT_BUFFERS = BiasBuffers()


class BiasUpdate:
    """The optimizer pre-step hook; `last_load` ([L, E] int64) is the load it last used."""

    def __init__(
        self,
        routers: list[nn.Module],
        rate: float,
        group: dist.ProcessGroup | None = None,
        buffers: BiasBuffers = DEFAULT_BUFFERS,
    ) -> None:
        for router in routers:
            if getattr(router, buffers.bias).dtype != torch.float32:
                # NOTE: in bf16 a 1e-3 step vanishes next to biases of order 0.1-1.
                raise ValueError("the routing bias must stay fp32 (do not cast buffers to bf16)")
        self.routers = routers
        self.buffers = buffers
        self.rate = rate
        self.group = group
        self.last_load: torch.Tensor | None = None
        # The device guard's verdict of the step whose update runs next (moetrain.loop.step):
        # a skipped step moves no bias, without the host reading the verdict.
        self.skip: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, _optimizer: Any = None, _args: Any = None, _kwargs: Any = None) -> None:
        # NOTE: the buffers are looked up at each call: loading a checkpoint or moving the
        # model may replace a module's buffer tensors.
        biases = [getattr(r, self.buffers.bias) for r in self.routers]
        counts = [getattr(r, self.buffers.counts) for r in self.routers]
        load = torch.stack(counts)  # [L, E] int64
        if self.rate == 0:  # frozen bias: only clear the counts
            for count in counts:
                count.zero_()
            return
        if dist.is_initialized():
            dist.all_reduce(load, group=self.group)  # the global batch's assignments
        step = self.rate * torch.sign(load.double().mean(-1, keepdim=True) - load.double())
        if self.skip is not None:
            step = torch.where(self.skip, 0.0, step)
        for bias, count, delta in zip(biases, counts, step, strict=True):
            bias.add_(delta.to(bias.dtype))
            count.zero_()
        self.last_load = load

    @torch.no_grad()
    def discard(self) -> None:
        """Forget the counts of a step that is not applied (`moetrain.loop.guard`): the bias
        moves only with an update, so a skipped step leaves it as it was."""
        for router in self.routers:
            getattr(router, self.buffers.counts).zero_()


def bias_routers(model: nn.Module, buffers: BiasBuffers = DEFAULT_BUFFERS) -> list[nn.Module]:
    """The modules of `model` that register both of `buffers`' buffers themselves, in
    module order. A module that registers one without the other is refused: its bias would
    stay frozen without a word, or its counts would never be cleared."""
    routers = []
    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        has_bias, has_counts = buffers.bias in own, buffers.counts in own
        if has_bias and has_counts:
            bias, counts = own[buffers.bias], own[buffers.counts]
            if counts.dtype != torch.int64 or bias.shape != counts.shape or bias.dim() != 1:
                raise ValueError(
                    f"{name}: {buffers.bias} {tuple(bias.shape)} and {buffers.counts} "
                    f"{tuple(counts.shape)} {counts.dtype} must be [num_experts] each, the "
                    "counts int64 (summed exactly over the ranks)"
                )
            routers.append(module)
        elif has_bias or has_counts:
            have, lack = (buffers.bias, buffers.counts)[:: 1 if has_bias else -1]
            raise ValueError(
                f"{name} registers the buffer {have} but not {lack}: the aux-loss-free bias "
                f"update needs both (register {lack}, or name other buffers in the model "
                "spec's bias_buffers)"
            )
    return routers


def attach_bias_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rate: float,
    group: dist.ProcessGroup | None = None,
    buffers: BiasBuffers = DEFAULT_BUFFERS,
) -> BiasUpdate | None:
    """Register the bias update on `optimizer` for every router of `model` that holds
    `buffers` (the spec's `bias_buffers`); None when the model has none. `optimizer` None
    (this rank trains no parameter): the caller runs the update where the optimizer step
    would be."""
    routers = bias_routers(model, buffers)
    if not routers:
        return None
    update = BiasUpdate(routers, rate, group, buffers)
    if optimizer is not None:
        optimizer.register_step_pre_hook(update)
    return update
