"""Expert parallelism: routed experts sharded on dim 0 over `ep`, tokens moved by all-to-all.

A MoE layer hands its routed tokens to a `moetrain.models.common.moe.Permute`, calls its experts
module on what that returns (`moetrain.models.common.moe.RoutedExperts`), and sums the output rows
per token with an `Unpermute`. EP wraps the three from outside with hooks:

    permute, post-forward:  (x [T, H], counts [E], token_of [N], weights [N]) -> send:
                            the dispatch, started -> rows (maybe in flight)
    experts, pre-forward:   rows -> arrive: wait for them
                            -> (x_local [R, H], counts [E/ep], row_of_local, weights_local)
    experts, post-forward:  y_local [N_local, H] -> combine, started -> rows (in flight)
    unpermute, pre-forward: (rows, token_of [N], T) -> wait for the combine -> the rows the
                            sum takes ([N, H], or [P, H] already summed per pair), weighted
                            by the experts (the routing weights travel with the tokens)

NOTE: a transfer started without waiting runs on the process group's own threads (gloo) or
stream (NCCL) while the layer computes what does not need it (`parallel.ep_overlap`):
- shared: the combine is in flight while the layer's shared experts run;
- chunks: the layer splits its tokens in two and sends both chunks before the experts
  run, so chunk B's dispatch is in flight while chunk A's experts compute, and chunk A's
  combine while chunk B's do.
The backward mirrors it: each transfer's gradient is started where the forward waited
and waited for where the forward started it (`moetrain.parallelisms.all_to_all._Landed`). Only when
a transfer is waited for moves; with one chunk the arithmetic is that of `none`.

Two dispatchers sit behind the same calls. `AllToAllDispatcher` (an `ep` group inside one
node) sends every (token, expert) assignment whose expert lives on another rank, drop-less,
with variable splits and no padding.
`moetrain.parallelisms.node_dispatch.NodeDispatcher` (an `ep` group over whole nodes) sends a token
across to each destination node once, then fans it out inside the node.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from moetrain.parallelisms.all_to_all import NOTHING, ROUTING, ROWS, Dispatcher, Traffic, all_to_all
from moetrain.parallelisms.node_dispatch import NodeDispatcher


class TokenDispatcher(Protocol):
    """Moves routed tokens to the ranks that own their experts, and their outputs back.

    A DeepEP implementation would plug in behind the same calls.
    """

    def send(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        token_of: torch.Tensor,
        weights: torch.Tensor,
        wait: bool,
    ) -> torch.Tensor:
        """Start moving the routed tokens (x [T, H], counts [E], token_of [N], weights [N])
        to their experts' ranks; `wait=False` returns while the last transfer runs. Returns
        what `arrive` takes."""
        ...

    def arrive(
        self, sent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Wait for a `send`; the experts' arguments: rows [R, H], counts [E/ep], the row
        of each local assignment (None: row i) and its routing weight, which the experts
        apply."""
        ...

    def combine(self, y_local: torch.Tensor, wait: bool) -> torch.Tensor:
        """The experts' rows [N_local, H] back to their tokens' ranks; `wait=False` returns
        while the last transfer runs (see `landed`)."""
        ...

    def landed(
        self, rows: torch.Tensor, token_of: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Wait for the combine that returned `rows`; the sum's arguments (rows, token of
        each row, tokens) for this dispatcher's rows."""
        ...

    def reset_traffic(self) -> Traffic:
        """The bytes sent since the last reset (the trainer logs them per step); resets."""
        ...


def _source_major_to_expert_major(recv_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Row permutation that reorders received tokens from (source rank, local expert) order
    to (local expert, source rank) order. recv_counts: [ep, E_local]; `rows`: their sum, as
    the host already holds it (the split sizes): reading it again would be a device sync."""
    flat = recv_counts.flatten()  # chunk sizes in arrival order
    starts = torch.cumsum(flat, 0) - flat  # where each chunk starts in arrival order
    sizes = recv_counts.t().flatten()  # chunk sizes in expert-major order
    chunk_starts = starts.view_as(recv_counts).t().flatten()
    chunks = torch.arange(sizes.numel(), device=flat.device)
    chunk_of_row = torch.repeat_interleave(chunks, sizes, output_size=rows)
    row_in_chunk = (
        torch.arange(rows, device=flat.device) - (torch.cumsum(sizes, 0) - sizes)[chunk_of_row]
    )
    return chunk_starts[chunk_of_row] + row_in_chunk


class AllToAllDispatcher(Dispatcher):
    """One all-to-all over the `ep` group, one row per (token, expert) assignment, and one
    of their routing weights: the experts weight their rows, as in one process, and the
    combine only sums them where the token lives.

    NOTE: why the weights travel (4 bytes a row): the product's gradient for the weights
    reads the expert's output. Kept at the source it is the combine's receive buffer, top-k
    rows of the model width a token, held from forward to backward; at the expert,
    `selective` rebuilds it instead (moetrain/models/common/moe.py, `GroupedExperts.ffn`)."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int, ranks_per_node: int) -> None:
        group = ep_mesh.get_group()
        node_of = [g // ranks_per_node for g in torch.distributed.get_process_group_ranks(group)]
        me = node_of[ep_mesh.get_local_rank()]
        super().__init__({0: group}, {0: [node != me for node in node_of]})
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep

    def send(self, x, tokens_per_expert, token_of, weights, wait=True):
        send_counts = tokens_per_expert.view(self.ep, self.local_experts)  # [dest rank, expert]
        ones = [1] * self.ep  # one row of counts [local experts] to each rank
        recv_counts = all_to_all(send_counts, ones, ones, self.handle, 0, NOTHING)  # [src, e]
        # NOTE: the host needs the split sizes: this is the device sync that breaks FSDP's
        # implicit prefetch (see moetrain/parallelisms/fsdp.py).
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        # The small weights first: on one NCCL stream they would queue behind the rows.
        weights_in = all_to_all(weights, recv_splits, send_splits, self.handle, 0, ROUTING)
        keep = (recv_counts, send_splits, recv_splits, weights_in)
        out = self.start("ep.dispatch", keep, x[token_of], recv_splits, send_splits, 0, ROWS, wait)
        self._sending.append((out, None))
        return out

    def arrive(self, sent):
        x_recv, (recv_counts, send_splits, recv_splits, weights), _ = self.arrived(sent)
        perm = _source_major_to_expert_major(recv_counts, sum(recv_splits))
        self._pending.append((perm, send_splits, recv_splits))
        return x_recv[perm], recv_counts.sum(0), None, weights[perm]

    def combine(self, y_local: torch.Tensor, wait: bool) -> torch.Tensor:
        perm, send_splits, recv_splits = self._pending.pop(0)
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)  # back to arrival order
        # [N, H] weighted, in the source's expert-major order
        return self.start("ep.combine", None, y_recv, send_splits, recv_splits, 0, ROWS, wait)

    def landed(self, rows, token_of, tokens):
        rows, _ = self.wait_for(rows)
        return rows, token_of, tokens


def apply_expert_parallel(
    layer: tuple[nn.Module, nn.Module, nn.Module],
    ep_mesh: DeviceMesh,
    ranks_per_node: int,
    node_meshes: tuple[DeviceMesh, DeviceMesh] | None = None,
    overlap: str = "shared",
) -> TokenDispatcher:
    """Shard a MoE layer's stacked expert weights on dim 0 over `ep_mesh` and route tokens
    to them. `layer`: its (Permute, routed experts, Unpermute) modules.

    Parameters become DTensors `Shard(0)` (global shapes kept: checkpoints and clipping see
    the truth); FSDP later adds `Shard(1)` on `efsdp` on top. `node_meshes`: the `ep`
    group's (across nodes, inside a node) split when it spans whole nodes (two-stage
    dispatch); else one all-to-all, whose inter-node bytes `ranks_per_node` tells apart.
    `overlap` (parallel.ep_overlap): "none" waits for each transfer at once; "shared" leaves
    the combine in flight until `Unpermute`; "chunks" also leaves each dispatch in flight
    until its experts run (the layer calls Permute for every chunk before the experts).
    """
    permute, experts, routed_sum = layer
    num_experts = None
    for name, param in list(experts.named_parameters(recurse=False)):
        num_experts = param.shape[0]
        sharded = nn.Parameter(
            distribute_tensor(param.data, ep_mesh, [Shard(0)]), requires_grad=param.requires_grad
        )  # a frozen base (LoRA) stays frozen
        experts.register_parameter(name, sharded)
    if node_meshes is None:
        dispatcher: TokenDispatcher = AllToAllDispatcher(ep_mesh, num_experts, ranks_per_node)
    else:
        rail, node = node_meshes
        # Expert e lives on ep rank e // (E / ep); the two-stage routing assumes ep rank =
        # node index * ranks per node + local index (moetrain/parallelisms/mesh.py builds it so).
        if rail.get_local_rank() * node.size() + node.get_local_rank() != ep_mesh.get_local_rank():
            raise ValueError("the node split of the ep mesh does not follow the ep ranks' order")
        dispatcher = NodeDispatcher(rail, node, num_experts)

    # NOTE: under train.compile the hooks run eagerly (a graph break on each side of the
    # experts): the dispatch reads split sizes on the host, and traced code would bake each
    # dispatcher's handle and each step's token counts in, one recompile per layer and step.
    @torch.compiler.disable
    def send_hook(_module, _args, routed):
        return (dispatcher.send(*routed, wait=overlap != "chunks"),)

    @torch.compiler.disable
    def arrive_hook(_module, args):
        return dispatcher.arrive(*args)

    @torch.compiler.disable
    def combine_hook(_module, _args, y_local):
        return dispatcher.combine(y_local, wait=overlap == "none")

    @torch.compiler.disable
    def sum_hook(_module, args):
        return dispatcher.landed(*args)

    permute.register_forward_hook(send_hook)
    experts.register_forward_pre_hook(arrive_hook)
    experts.register_forward_hook(combine_hook)
    routed_sum.register_forward_pre_hook(sum_hook)
    return dispatcher
