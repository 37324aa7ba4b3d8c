"""Expert parallelism: routed experts sharded on dim 0 over `ep`, tokens moved by all-to-all.

The model's experts module takes tokens sorted expert-major plus the count per expert
(`models.common.moe.GroupedExperts`). EP wraps it from outside with two hooks:

    pre-forward:  (x_sorted [N, H], counts [E]) -> dispatch -> (x_local [N', H], counts [E/ep])
    post-forward: y_local [N', H] -> combine -> y_sorted [N, H]   (same order as x_sorted)

Drop-less: the all-to-all carries exactly the (token, expert) assignments whose expert
lives on another rank, with variable splits and no padding.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from parallelisms.trace import named_range


class TokenDispatcher(Protocol):
    """Moves expert-major tokens to the ranks that own their experts, and back.

    `all_to_all` is the default implementation; a DeepEP one plugs in behind the same
    calls. `bytes_sent` counts what this rank sent (forward and backward) since the last reset.
    """

    bytes_sent: int

    def dispatch(
        self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, y_local: torch.Tensor) -> torch.Tensor: ...

    def reset_bytes(self) -> int:
        """The bytes sent since the last reset (the trainer logs them per step); resets."""
        ...


# Live dispatchers by handle: the all-to-all op takes plain values, not Python objects.
_DISPATCHERS: weakref.WeakValueDictionary[int, AllToAllDispatcher] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("moetrain::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], dispatcher: int, count: bool
) -> torch.Tensor:
    """all_to_all_single over a dispatcher's `ep` group with variable splits (rows of x).

    One op, not a Python function: selective activation checkpointing keeps its output and
    hands it back to the replayed forward, so the body below (the transfer and, with
    `count`, its bytes) runs only when data really moves. Its gradient is the reverse op.
    """
    owner = _DISPATCHERS[dispatcher]
    if count:
        owner.count(in_splits, x)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=owner.group)
    return out


@all_to_all.register_fake
def _(x, out_splits, in_splits, dispatcher, count):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, out_splits, in_splits, dispatcher, _ = inputs
    ctx.args = (out_splits, in_splits, dispatcher)


def _all_to_all_backward(ctx, grad):
    out_splits, in_splits, dispatcher = ctx.args
    with named_range("ep.all_to_all.backward"):  # dispatch's backward combines, and back
        grad_in = all_to_all(grad, in_splits, out_splits, dispatcher, True)
    return grad_in, None, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def _source_major_to_expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row permutation that reorders received tokens from (source rank, local expert) order
    to (local expert, source rank) order. recv_counts: [ep, E_local]."""
    flat = recv_counts.flatten()  # chunk sizes in arrival order
    starts = torch.cumsum(flat, 0) - flat  # where each chunk starts in arrival order
    sizes = recv_counts.t().flatten()  # chunk sizes in expert-major order
    chunk_starts = starts.view_as(recv_counts).t().flatten()
    chunk_of_row = torch.repeat_interleave(torch.arange(sizes.numel(), device=flat.device), sizes)
    row_in_chunk = (
        torch.arange(int(sizes.sum()), device=flat.device)
        - (torch.cumsum(sizes, 0) - sizes)[chunk_of_row]
    )
    return chunk_starts[chunk_of_row] + row_in_chunk


class AllToAllDispatcher:
    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self.local_experts = num_experts // self.ep
        self.bytes_sent = 0
        # per in-flight forward (or its replay under activation checkpointing), pushed by
        # dispatch, popped by combine: (perm, send, recv) splits
        self._pending: list[tuple] = []
        self.handle = next(_handles)
        _DISPATCHERS[self.handle] = self

    def count(self, splits: list[int], x: torch.Tensor) -> None:
        """Bytes this rank sends to the others (its own chunk stays local)."""
        rows = sum(splits) - splits[self.rank]
        self.bytes_sent += rows * x[0:1].numel() * x.element_size() if x.numel() else 0

    def dispatch(
        self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        send_counts = tokens_per_expert.view(self.ep, self.local_experts)  # [dest rank, expert]
        ones = [1] * self.ep  # one row of counts [local experts] to each rank
        recv_counts = all_to_all(send_counts, ones, ones, self.handle, False)  # [source, expert]
        # NOTE: the host needs the split sizes: this is the device sync that breaks FSDP's
        # implicit prefetch (see parallelisms/fsdp.py).
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        x_recv = all_to_all(x_sorted, recv_splits, send_splits, self.handle, True)
        perm = _source_major_to_expert_major(recv_counts)
        self._pending.append((perm, send_splits, recv_splits))
        return x_recv[perm], recv_counts.sum(0)

    def combine(self, y_local: torch.Tensor) -> torch.Tensor:
        perm, send_splits, recv_splits = self._pending.pop()
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)  # back to arrival order
        return all_to_all(y_recv, send_splits, recv_splits, self.handle, True)

    def reset_bytes(self) -> int:
        if self._pending:  # called between steps: every dispatch has been combined
            raise RuntimeError(f"{len(self._pending)} dispatches were never combined")
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent


def apply_expert_parallel(experts: nn.Module, ep_mesh: DeviceMesh) -> AllToAllDispatcher:
    """Shard the stacked expert weights on dim 0 over `ep_mesh` and route tokens to them.

    Parameters become DTensors `Shard(0)` (global shapes kept: checkpoints and clipping see
    the truth); FSDP later adds `Shard(1)` on `efsdp` on top.
    """
    num_experts = None
    for name, param in list(experts.named_parameters(recurse=False)):
        num_experts = param.shape[0]
        sharded = nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))
        experts.register_parameter(name, sharded)
    dispatcher = AllToAllDispatcher(ep_mesh, num_experts)

    # NOTE: under train.compile the hooks run eagerly (a graph break on each side of the
    # experts): the dispatch reads split sizes on the host, and traced code would bake each
    # dispatcher's handle and each step's token counts in, one recompile per layer and step.
    @torch.compiler.disable
    def pre_hook(_module, args):
        x_sorted, tokens_per_expert = args
        with named_range("ep.dispatch"):
            return dispatcher.dispatch(x_sorted, tokens_per_expert)

    @torch.compiler.disable
    def post_hook(_module, _args, y_local):
        with named_range("ep.combine"):
            return dispatcher.combine(y_local)

    experts.register_forward_pre_hook(pre_hook)
    experts.register_forward_hook(post_hook)
    return dispatcher
