"""The all-to-all that expert-parallel dispatchers move tokens with, and what they count.

A dispatcher (`parallelisms.expert_parallel`, `parallelisms.node_dispatch`) owns one or more
process groups, its "stages": 0 is the whole `ep` group; a two-stage dispatcher also has 1
(the ranks of the same local index on every node: the inter-node links) and 2 (the ranks of
one node). Each transfer counts the bytes this rank sends to other ranks, split by what
crosses a node boundary, so the trainer can log them and tests can check them exactly.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from parallelisms.trace import named_range

# What a transfer counts (the op's `count`): nothing (split sizes), token rows, or routing
# (each assignment's expert and weight, which a two-stage dispatch sends with the rows).
NOTHING, ROWS, ROUTING = 0, 1, 2


class Traffic(NamedTuple):
    """Bytes one rank sent to other ranks (its own chunk stays local), forward and backward."""

    sent: int  # everything: token rows, gradients and routing
    internode: int  # token rows (and their gradients) to ranks on other nodes
    internode_routing: int  # routing metadata to ranks on other nodes


class Dispatcher:
    """Registers itself for the op below and holds the traffic counters."""

    def __init__(self, groups: dict[int, dist.ProcessGroup], remote: dict[int, list[bool]]):
        """groups: stage -> process group; remote: stage -> per peer (group rank order),
        whether that peer is on another node."""
        self.groups, self.remote = groups, remote
        self.ranks = {stage: dist.get_rank(group) for stage, group in groups.items()}
        self._sent = self._internode = self._internode_routing = 0
        # per in-flight forward (or its replay under activation checkpointing), pushed by
        # dispatch, popped by combine
        self._pending: list[tuple] = []
        # the transfer the last `all_to_all(..., wait=False)` left running (None: its body
        # did not run, as in a selective-checkpoint replay, which gets the kept output)
        self.started: dist.Work | None = None
        # combines started and not yet waited for: (output, its transfer, what to keep)
        self._in_flight: list[tuple] = []
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

    def start(self, keep, x, out_splits, in_splits, stage, count, wait) -> torch.Tensor:
        """`all_to_all` of x over a stage; its output, which `wait_for` hands `keep` back
        for once the transfer has landed (`wait=False`: maybe still running)."""
        self.started = None
        out = all_to_all(x, out_splits, in_splits, self.handle, stage, count, wait)
        self._in_flight.append((out, self.started, keep))
        return out

    def wait_for(self, out: torch.Tensor):
        """Wait for the transfer `start` returned `out` of; what it was given to keep."""
        for i, (started, work, keep) in enumerate(self._in_flight):
            if started is out:
                del self._in_flight[i]
                if work is not None:
                    with named_range("ep.combine.wait"):
                        work.wait()
                return keep
        raise RuntimeError("routed rows that no combine of this dispatcher returned")

    def reset_traffic(self) -> Traffic:
        """The traffic since the last reset (the trainer logs it per step); resets."""
        if self._pending or self._in_flight:  # between steps: every dispatch has landed
            raise RuntimeError(
                f"{len(self._pending)} dispatches were never combined, "
                f"{len(self._in_flight)} combines never waited for"
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

    One op, not a Python function: selective activation checkpointing keeps its output and
    hands it back to the replayed forward, so the body below (the transfer and its bytes)
    runs only when data really moves. Its gradient is the reverse op, counted alike.
    `wait=False` returns while the transfer still runs (on gloo's own threads, or NCCL's
    stream): the output must not be read before the dispatcher's `started` is waited for.
    """
    owner = _DISPATCHERS[dispatcher]
    if count != NOTHING:
        owner.count(stage, count, in_splits, x)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    group = owner.groups[stage]
    work = dist.all_to_all_single(
        out, x.contiguous(), out_splits, in_splits, group=group, async_op=not wait
    )
    owner.started = None if wait else work
    return out


@all_to_all.register_fake
def _(x, out_splits, in_splits, dispatcher, stage, count, wait=True):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, out_splits, in_splits, dispatcher, stage, count, _wait = inputs
    ctx.args = (out_splits, in_splits, dispatcher, stage, count)


def _all_to_all_backward(ctx, grad):
    out_splits, in_splits, dispatcher, stage, count = ctx.args
    with named_range("ep.all_to_all.backward"):  # dispatch's backward combines, and back
        grad_in = all_to_all(grad, in_splits, out_splits, dispatcher, stage, count)
    return grad_in, None, None, None, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """Where each chunk starts, for chunks of these sizes laid end to end."""
    return torch.cumsum(counts, 0) - counts
