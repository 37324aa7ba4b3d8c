"""Forward only through pipeline stages (`parallel.pp` > 1): the held-out loss, in training
(`moetrain.loop.pipelined`) and in `python -m moetrain.evaluate`.

Not torch's schedules: their `eval()` runs the training schedule's actions with the
backward ones turned off, and the V schedules (ZBVZeroBubble, DualPipeV) still run their
backward-input actions there, which fail ("can't steal_bwd_input if this stage doesn't have
backward"). So every schedule evaluates the same plain way: stage by stage in model order,
each stage's micro-batches in order, the hidden states sent point to point to the rank of
the next stage (or handed over in place when that stage is on this rank too, the V's turn).

Every rank posts its sends and receives in that one global order (stage, micro-batch) and
waits for a stage's sends at its end: a stage's sends are received once the next stage's
rank has finished its earlier stages, which by the same argument finish, so no backend can
deadlock (even one whose send waits for its receive, as gloo's does). A stage starts on a
micro-batch as soon as the previous stage sends it, so stages of different ranks overlap
as in a forward-only 1F1B.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moetrain.parallelisms.dims import stage_rank
from moetrain.parallelisms.pipeline import StageModule


class ForwardOnly:
    """This rank's stages, run forward only over a batch of micro-batches."""

    def __init__(
        self,
        stages: list[StageModule],
        indices: list[int],
        num_stages: int,
        schedule: str,
        group: Any,
        device: torch.device,
        metas: dict[int, tuple[Any, Any]],
    ) -> None:
        """`schedule`: parallel.pp_schedule (where each stage is); `metas`: stage index ->
        (example input, example output) on the meta device, for the received buffers'
        shape and dtype."""
        self.stages = dict(zip(indices, stages, strict=True))
        self.num_stages, self.group, self.device, self.metas = num_stages, group, device, metas
        pp = dist.get_world_size(group)
        # stage index -> the pp rank that runs it (its rank in `group`)
        self.rank_of = [stage_rank(i, pp, schedule) for i in range(num_stages)]
        self.has_last = num_stages - 1 in self.stages

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        micro_batches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        **inputs: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """`micro_batches` micro-batches stacked on dim 0 (input_ids, target and the
        keyword inputs) through the stages; the last stage's `loss_fn(output, target)` of
        each, in order (empty on the other ranks). The routers add no loss: nothing is
        backpropagated."""
        kwargs = {k: v for k, v in inputs.items() if v is not None}
        rows = input_ids.shape[0] // micro_batches
        routers = {i: stage.router_loss for i, stage in self.stages.items()}
        losses: list[torch.Tensor] = []
        handed: dict[int, torch.Tensor] = {}  # micro-batch -> this rank's previous stage's output
        try:
            for index, stage in sorted(self.stages.items()):
                stage.router_loss = None
                here = self.rank_of[index]
                sending = []
                for m in range(micro_batches):
                    part = slice(m * rows, (m + 1) * rows)
                    if index == 0:
                        x = input_ids[part]
                    elif self.rank_of[index - 1] == here:
                        x = handed.pop(m)
                    else:
                        x = self._receive(index, rows)
                    out = stage(x, **{k: v[part] for k, v in kwargs.items()})
                    if index == self.num_stages - 1:
                        losses.append(loss_fn(out, target[part]))
                    elif self.rank_of[index + 1] == here:
                        handed[m] = out
                    else:
                        # NOTE: waited for at the stage's end, not before the next send: the
                        # next stage's rank may still be running an earlier stage, whose
                        # inputs this rank sends after this stage (a looped schedule's rank
                        # 1 waiting on stage 1's first send to rank 0, still sending stage
                        # 0's third micro-batch, which rank 1 receives only after: a
                        # deadlock from 3 micro-batches). A stage's outputs are the hidden
                        # states of its micro-batches, as the training schedules hold.
                        dst = self.rank_of[index + 1]
                        send = dist.isend(out.contiguous(), group=self.group, group_dst=dst)
                        sending.append(send)
                for send in sending:
                    send.wait()
        finally:
            for i, stage in self.stages.items():
                stage.router_loss = routers[i]
        return losses

    def _receive(self, index: int, rows: int) -> torch.Tensor:
        """Stage `index`'s input for one micro-batch of `rows` rows: the previous stage's
        hidden states, from its rank."""
        meta = self.metas[index][0]
        buffer = torch.empty((rows, *meta.shape[1:]), dtype=meta.dtype, device=self.device)
        dist.recv(buffer, group=self.group, group_src=self.rank_of[index - 1])
        return buffer
