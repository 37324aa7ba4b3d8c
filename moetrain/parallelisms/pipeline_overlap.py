"""DualPipeV's overlapped forward and backward with expert parallelism: one micro-batch's
forward and another's backward run at once, each one's all-to-alls under the other's
compute (`parallel.pp_schedule=DualPipeV` with `parallel.ep > 1`).

torch's DualPipeV schedule pairs, in its steady phase, the forward of one stage's
micro-batch with the full backward of the rank's other stage's (an `OVERLAP_F_B` action),
and by default runs the two one after the other. Here the pair runs on two threads: the
backward on a second thread, the forward on the calling one. Each expert all-to-all
(forward or backward, `moetrain::all_to_all`) takes a turn of the rank's `Lockstep`, which
the two threads pass back and forth: while one thread's transfer runs, the other computes
until its own next transfer, and waits there for the turn.

NOTE: the turns alternate in one order on every rank (the forward's first transfer first,
then the backward's, and so on; a thread that finishes leaves the turns to the other), so
the collectives of the `ep` group are issued in the same order everywhere, as they must
be. Only transfers take turns: FSDP keeps a stage's units gathered through the step under
pipeline stages, a pair whose backward is its stage's last (which reduces the gradients)
runs in turn, ring attention is refused beside this overlap (moetrain/config/checks.py),
and the V schedules refuse activation checkpointing, whose replay in the backward would
issue a forward's transfers out of turn.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moetrain.parallelisms.trace import named_range

FORWARD, BACKWARD = "forward", "backward"


class Lockstep:
    """Turns for the expert transfers of an overlapped forward and backward."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._role = threading.local()  # which side this thread runs, None: no overlap
        self._running: set[str] = set()
        self._next = FORWARD

    def begin(self) -> None:
        """Both sides are about to run; the forward's transfer comes first."""
        with self._cond:
            self._running, self._next = {FORWARD, BACKWARD}, FORWARD

    @contextmanager
    def side(self, role: str) -> Iterator[None]:
        """Run the body as `role`; when it ends (or fails), the turns are the other's."""
        self._role.value = role
        try:
            yield
        finally:
            self._role.value = None
            with self._cond:
                self._running.discard(role)
                self._cond.notify_all()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for one transfer (a no-op outside an overlapped pair)."""
        role = getattr(self._role, "value", None)
        if role is None:
            yield
            return
        other = BACKWARD if role == FORWARD else FORWARD
        with self._cond:
            with named_range("pp.overlap.turn_wait"):
                self._cond.wait_for(lambda: self._next == role or other not in self._running)
        try:
            yield
        finally:
            with self._cond:
                self._next = other
                self._cond.notify_all()


def overlapped_forward_backward(lockstep: Lockstep):
    """The schedule's function for an `OVERLAP_F_B` action: its two sub-actions at once.

    It does what torch's runtime does for a FORWARD and a FULL_BACKWARD action (wait for the
    received inputs, run the chunk, compute the loss, hand the output to the rank's other
    stage), through the runtime's own methods."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    def run(action: Any, ctx: Any) -> None:
        schedule = ctx.schedule_ref
        stages = {stage.stage_index: stage for stage in schedule._stages}
        fwd, bwd = action.sub_actions
        f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
        f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
        if not f_stage.is_first and fwd.stage_index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
        if not b_stage.is_last and bwd.stage_index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
        last = schedule.backward_counter[bwd.stage_index] + 1 == schedule._n_microbatches

        def backward() -> None:
            schedule._assert_unsharded(b_stage)
            loss = schedule._maybe_get_loss(b_stage, b_mb)
            schedule.backward_counter[bwd.stage_index] += 1
            with named_range(f"pp.overlap.backward.stage{bwd.stage_index}.mb{b_mb}"):
                b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if bwd.stage_index - 1 in stages:  # the V's turn on this rank
                stages[bwd.stage_index - 1].set_local_bwd_input(
                    b_stage.get_local_bwd_output(b_mb), b_mb
                )

        def forward() -> None:
            schedule._assert_unsharded(f_stage)
            with named_range(f"pp.overlap.forward.stage{fwd.stage_index}.mb{f_mb}"):
                out = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
            schedule._maybe_compute_loss(f_stage, out, ctx.target_mbs, f_mb)
            if fwd.stage_index + 1 in stages:
                stages[fwd.stage_index + 1].set_local_fwd_input(out, f_mb)

        if last or fwd.stage_index == bwd.stage_index:
            # NOTE: in turn, as torch's runtime: a stage's last backward reduces its
            # gradients (FSDP's collectives, which take no turns), and one stage's forward
            # and backward share its layers' dispatchers.
            forward()
            backward()
            return
        failed: list[BaseException] = []

        def backward_side() -> None:
            with lockstep.side(BACKWARD):
                try:
                    backward()
                except BaseException as err:  # re-raised on the calling thread
                    failed.append(err)

        lockstep.begin()
        thread = threading.Thread(target=backward_side, name="pp-overlap-backward")
        thread.start()
        try:
            with lockstep.side(FORWARD):
                forward()
        finally:
            thread.join()
        if failed:
            raise failed[0]

    return run
