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

    def reset_traffic(self) -> Traffic:
        """The traffic since the last reset (the trainer logs it per step); resets."""
        if self._pending:  # called between steps: every dispatch has been combined
            raise RuntimeError(f"{len(self._pending)} dispatches were never combined")
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
) -> torch.Tensor:
    """all_to_all_single over one of a dispatcher's groups with variable splits (rows of x).

    One op, not a Python function: selective activation checkpointing keeps its output and
    hands it back to the replayed forward, so the body below (the transfer and its bytes)
    runs only when data really moves. Its gradient is the reverse op, counted alike.
    """
    owner = _DISPATCHERS[dispatcher]
    if count != NOTHING:
        owner.count(stage, count, in_splits, x)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=owner.groups[stage])
    return out


@all_to_all.register_fake
def _(x, out_splits, in_splits, dispatcher, stage, count):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, out_splits, in_splits, dispatcher, stage, count = inputs
    ctx.args = (out_splits, in_splits, dispatcher, stage, count)


def _all_to_all_backward(ctx, grad):
    out_splits, in_splits, dispatcher, stage, count = ctx.args
    with named_range("ep.all_to_all.backward"):  # dispatch's backward combines, and back
        grad_in = all_to_all(grad, in_splits, out_splits, dispatcher, stage, count)
    return grad_in, None, None, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """Where each chunk starts, for chunks of these sizes laid end to end."""
    return torch.cumsum(counts, 0) - counts
