"""The all-to-all that expert-parallel dispatchers move tokens with, and what they count.

A dispatcher (`moetrain.parallelisms.expert_parallel`, `moetrain.parallelisms.node_dispatch`) owns one or more
process groups, its "stages": 0 is the whole `ep` group; a two-stage dispatcher also has 1
(the ranks of the same local index on every node: the inter-node links) and 2 (the ranks of
one node). Each transfer counts the bytes this rank sends to other ranks, split by what
crosses a node boundary, so the trainer can log them and tests can check them exactly.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from moetrain.parallelisms.trace import named_range

if TYPE_CHECKING:
    from moetrain.parallelisms.pipeline_overlap import Lockstep

# What a transfer counts (the op's `count`): nothing (split sizes), token rows, or routing
# (each assignment's expert and weight, which a two-stage dispatch sends with the rows).
NOTHING, ROWS, ROUTING = 0, 1, 2


class Traffic(NamedTuple):
    """Bytes one rank sent to other ranks (its own chunk stays local), forward and backward."""

    sent: int  # everything: token rows, gradients and routing
    internode: int  # token rows (and their gradients) to ranks on other nodes
    internode_routing: int  # routing metadata to ranks on other nodes


class InFlight(NamedTuple):
    """An all-to-all `Dispatcher.start` issued: its output, and what its wait needs."""

    out: torch.Tensor
    work: dist.Work | None  # None: already landed (waited for, or its body did not run)
    keep: object  # what the caller handed `start` to get back once it lands
    reverse: tuple[list[int], list[int], int, int]  # (out, in) splits, stage, count: backward
    name: str  # the profiler range of its issue; its wait is "{name}.wait"


class Dispatcher:
    """Registers itself for the op below, holds the traffic counters and the transfers in
    flight."""

    def __init__(self, groups: dict[int, dist.ProcessGroup], remote: dict[int, list[bool]]):
        """groups: stage -> process group; remote: stage -> per peer (group rank order),
        whether that peer is on another node."""
        self.groups, self.remote = groups, remote
        self.ranks = {stage: dist.get_rank(group) for stage, group in groups.items()}
        self._sent = self._internode = self._internode_routing = 0
        # First in, first out (a layer's chunks are sent, computed and combined in order;
        # an activation-checkpoint replay of the layer runs its own sequence whole):
        self._sending: list[tuple] = []  # (output, extra state): pushed by send, for arrive
        self._pending: list[tuple] = []  # pushed by arrive, popped by combine
        # the transfer the last `all_to_all(..., wait=False)` left running (None: its body
        # did not run)
        self.started: dist.Work | None = None
        self._in_flight: list[InFlight] = []
        # gradients on their way back, started by `_Landed`: (gradient sent, its transfer)
        self._returning: list[tuple[torch.Tensor, InFlight]] = []
        # Set by the pipeline under DualPipeV (moetrain/parallelisms/pipeline_overlap.py): each
        # transfer's issue waits for its turn while a forward and a backward overlap.
        self.lockstep: Lockstep | None = None
        self.handle = next(_handles)
        _DISPATCHERS[self.handle] = self

    def count(self, stage: int, kind: int, splits: list[int], x: torch.Tensor) -> None:
        row_bytes = x[0:1].numel() * x.element_size() if x.numel() else 0
        me = self.ranks[stage]
        self._sent += row_bytes * (sum(splits) - splits[me])
        crossing = row_bytes * sum(n for n, far in zip(splits, self.remote[stage]) if far)
        if kind == ROWS:
            self._internode += crossing
        else:
            self._internode_routing += crossing

    def _issue(self, name, keep, x, out_splits, in_splits, stage, count, wait) -> InFlight:
        """`all_to_all` of x over a stage, issued under the profiler range `name`."""
        self.started = None
        with named_range(name):
            out = all_to_all(x, out_splits, in_splits, self.handle, stage, count, wait)
        return InFlight(out, self.started, keep, (in_splits, out_splits, stage, count), name)

    def start(self, name, keep, x, out_splits, in_splits, stage, count, wait) -> torch.Tensor:
        """`_issue`'s output, which `wait_for` lands (`wait=False`: the transfer may still
        be running)."""
        flight = self._issue(name, keep, x, out_splits, in_splits, stage, count, wait)
        self._in_flight.append(flight)
        return flight.out

    def _take(self, out: torch.Tensor) -> InFlight:
        for i, flight in enumerate(self._in_flight):
            if flight.out is out:
                return self._in_flight.pop(i)
        raise RuntimeError("a tensor that no all-to-all of this dispatcher left in flight")

    def wait_for(
        self, out: torch.Tensor, flowing: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, object]:
        """Wait for the transfer `start` returned `out` of (under "{name}.wait"); the landed
        output and what `start` was given to keep. `flowing`: what the caller was handed in
        place of `out` (a view of it: FSDP2 wraps the inputs of its units), which lands
        instead, so that the gradient takes the way autograd knows.

        A transfer started without waiting lands through `_Landed`, so that its gradient's
        way back is started as early in the backward as this wait came late in the forward.
        """
        flight = self._take(out)
        landed = out if flowing is None else flowing
        if flight.work is None:  # waited for at once, or a replay's kept output
            return landed, flight.keep
        with named_range(f"{flight.name}.wait"):
            flight.work.wait()
        return _Landed.apply(landed, self.handle, flight.reverse, flight.name), flight.keep

    def arrived(self, sent: torch.Tensor) -> tuple[torch.Tensor, object, object]:
        """`wait_for` the oldest `send` (whose output and extra state it queued on
        `_sending`), landing `sent`; also returns that extra state.

        NOTE: found by order, not by identity: `sent` may be a view of the send's output
        (see `wait_for`). A layer's chunks arrive in the order they were sent."""
        out, extra = self._sending.pop(0)
        landed, keep = self.wait_for(out, sent)
        return landed, keep, extra

    def start_back(self, name: str, grad: torch.Tensor, reverse: tuple) -> None:
        """Start the transfer of an output's gradient back (`reverse`: the output's
        `InFlight.reverse`), for `land_back(grad)`."""
        out_splits, in_splits, stage, count = reverse
        back = self._issue(name, None, grad, out_splits, in_splits, stage, count, False)
        self._returning.append((grad, back))

    def land_back(self, grad: torch.Tensor) -> torch.Tensor:
        """Wait for the transfer `start_back` started of `grad`; what arrived."""
        for i, (sent, flight) in enumerate(self._returning):
            if sent is grad:
                del self._returning[i]
                with named_range(f"{flight.name}.wait"):
                    flight.work.wait()
                return flight.out
        raise RuntimeError("a gradient whose way back no `_Landed` started")

    def reset_traffic(self) -> Traffic:
        """The traffic since the last reset (the trainer logs it per step); resets."""
        if self._sending or self._pending or self._in_flight or self._returning:  # all landed
            raise RuntimeError(
                f"{len(self._sending)} dispatches never arrived, {len(self._pending)} were "
                f"never combined, {len(self._in_flight) + len(self._returning)} transfers "
                "never waited for"
            )
        traffic = Traffic(self._sent, self._internode, self._internode_routing)
        self._sent = self._internode = self._internode_routing = 0
        return traffic


# Live dispatchers by handle: the all-to-all op takes plain values, not Python objects.
_DISPATCHERS: weakref.WeakValueDictionary[int, Dispatcher] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("moetrain::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    dispatcher: int,
    stage: int,
    count: int,
    wait: bool = True,
) -> torch.Tensor:
    """all_to_all_single over one of a dispatcher's groups with variable splits (rows of x).

    One op, not a Python function: one opaque call for dispatch modes and compile; the body
    below (the transfer and its bytes) runs only when data really moves. Its gradient is the reverse op, counted alike.
    `wait=False` returns while the transfer still runs (on gloo's own threads, or NCCL's
    stream): the output must not be read before the dispatcher's `started` is waited for.
    """
    owner = _DISPATCHERS[dispatcher]
    if count != NOTHING:
        owner.count(stage, count, in_splits, x)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    group = owner.groups[stage]
    with owner.lockstep.turn() if owner.lockstep is not None else nullcontext():
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=group, async_op=not wait
        )
    owner.started = None if wait else work
    return out


@all_to_all.register_fake
def _(x, out_splits, in_splits, dispatcher, stage, count, wait=True):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, out_splits, in_splits, dispatcher, stage, count, wait = inputs
    ctx.args = (out_splits, in_splits, dispatcher, stage, count, wait)


def _all_to_all_backward(ctx, grad):
    out_splits, in_splits, dispatcher, stage, count, wait = ctx.args
    if not wait:  # `_Landed` started the way back where the output landed; it ends here
        grad_in = _DISPATCHERS[dispatcher].land_back(grad)
    else:
        with named_range("ep.all_to_all.backward"):  # dispatch's backward combines, and back
            grad_in = all_to_all(grad, in_splits, out_splits, dispatcher, stage, count)
    return grad_in, None, None, None, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


class _Landed(torch.autograd.Function):
    """Where the output of an all-to-all started without waiting landed: nothing forward;
    backward, it starts its gradient's transfer back and leaves it in flight, and the
    all-to-all's own backward waits for it.

    NOTE: autograd runs ready nodes in reverse order of their creation. This node was made
    where the forward waited, so the nodes made between the issue and the wait (the compute
    the transfer hid under) run between its backward and the all-to-all's: they hide the
    transfer of the gradient too (under the name "{issue}.backward").
    """

    @staticmethod
    def forward(ctx, out, dispatcher, reverse, name):
        ctx.dispatcher, ctx.reverse, ctx.name = dispatcher, reverse, name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        _DISPATCHERS[ctx.dispatcher].start_back(f"{ctx.name}.backward", grad, ctx.reverse)
        return grad, None, None, None


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """Where each chunk starts, for chunks of these sizes laid end to end."""
    return torch.cumsum(counts, 0) - counts
