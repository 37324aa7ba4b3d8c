"""Two-stage expert dispatch for an `ep` group that spans whole nodes (DeepEP's internode
mode, with the plain all-to-all underneath).

The `ep` group is nodes x ranks_per_node ranks, in that order, so node n holds the experts
[n * E_node, (n + 1) * E_node). Each rank talks across nodes only to its "rail": the ranks of
the same local index on the other nodes.

    stage 1 (rail):   each (token, destination node) row once, with the routing of the
                      token's assignments on that node (expert inside the node, weight);
                      the rows are left in flight under `parallel.ep_overlap=chunks`
                      (the send; the rest is the arrive, when the chunk's experts run)
    stage 2 (node):   the relay that received it forwards one row per (token, rank) to the
                      ranks of its node that own the token's experts
    experts:          each rank computes its rows' weighted sums over their local experts
    combine:          stage 2 reversed, summed per (token, node) on the relay, then stage 1
                      reversed (one row per (token, node) crosses back, left in flight),
                      summed per token where the layer's `Unpermute` waits for it

A token's inter-node traffic is one row per remote node holding any of its experts, however
many of its experts sit there. With a router that limits each token to a few expert groups,
groups lined up with nodes (docs/parallelisms.md, "Expert parallelism") bound the nodes too.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from moetrain.models.common.row_sum import sum_rows
from moetrain.parallelisms.all_to_all import NOTHING, ROUTING, ROWS, Dispatcher, all_to_all
from moetrain.parallelisms.all_to_all import exclusive_cumsum as starts_of

RAIL, NODE = 1, 2  # the dispatcher's stages (moetrain/parallelisms/all_to_all.py)


def _counts(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `index`. NOTE: not bincount, which reads the
    index's max on the host (a device sync on CUDA); this one is [n] by construction."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index, torch.ones_like(index)
    )


class NodeDispatcher(Dispatcher):
    def __init__(self, rail_mesh: DeviceMesh, node_mesh: DeviceMesh, num_experts: int) -> None:
        self.nodes, self.per_node = rail_mesh.size(), node_mesh.size()
        rail_remote = [peer != rail_mesh.get_local_rank() for peer in range(self.nodes)]
        super().__init__(
            {RAIL: rail_mesh.get_group(), NODE: node_mesh.get_group()},
            {RAIL: rail_remote, NODE: [False] * self.per_node},
        )
        self.local_experts = num_experts // (self.nodes * self.per_node)
        self.node_experts = self.local_experts * self.per_node

    def _exchange(self, stage, rows, row_counts, routing, weights, assign_counts, wait=True):
        """Send rows [sum(row_counts), H] and their assignments' routing [A, 2] (row inside
        the sender's chunk, expert) and weights [A] to the stage's peers (chunks in peer
        order). -> the received rows, for `wait_for` (`wait=False`: still in flight), which
        hands back the rest: the routing with rows indexing the received rows, weights, and
        the (send, receive) row splits for the way back."""
        counts = torch.stack([row_counts, assign_counts], 1)  # [peers, 2]
        ones = [1] * len(row_counts)
        recv = all_to_all(counts, ones, ones, self.handle, stage, NOTHING)  # [peers, 2]
        # NOTE: one host read per stage for its rows' and assignments' splits (the device
        # sync any variable-split all-to-all needs).
        (send_rows, send_assign), (recv_rows, recv_assign) = torch.stack(
            [counts.t(), recv.t()]
        ).tolist()
        # The small routing first: on one NCCL stream it would queue behind the rows.
        routing_in = all_to_all(routing, recv_assign, send_assign, self.handle, stage, ROUTING)
        weights_in = all_to_all(weights, recv_assign, send_assign, self.handle, stage, ROUTING)
        sender = torch.repeat_interleave(
            torch.arange(len(ones), device=rows.device), recv[:, 1], output_size=len(routing_in)
        )
        row_in = routing_in[:, 0].long() + starts_of(recv[:, 0])[sender]
        keep = (row_in, routing_in[:, 1].long(), weights_in, (send_rows, recv_rows))
        name = "ep.dispatch" if stage == RAIL else "ep.dispatch.node"
        return self.start(name, keep, rows, recv_rows, send_rows, stage, ROWS, wait)

    def send(self, x, tokens_per_expert, token_of, weights, wait=True):
        tokens, device = x.shape[0], x.device
        experts = torch.arange(len(tokens_per_expert), device=device)
        expert = torch.repeat_interleave(experts, tokens_per_expert, output_size=len(token_of))
        node = expert // self.node_experts  # [N], non-decreasing (assignments expert-major)

        # Stage 1: one row per (destination node, token), node-major.
        pairs, pair_of = torch.unique(node * tokens + token_of, return_inverse=True)
        pair_node, pair_token = pairs // tokens, pairs % tokens
        pair_counts = _counts(pair_node, self.nodes)
        routing = torch.stack(
            [pair_of - starts_of(pair_counts)[node], expert - node * self.node_experts], 1
        )
        assign_counts = tokens_per_expert.view(self.nodes, -1).sum(1)
        out = self._exchange(
            RAIL, x[pair_token], pair_counts, routing.int(), weights, assign_counts, wait
        )
        self._sending.append((out, pair_token))
        return out

    def arrive(self, sent):
        rows1, (row1, expert1, weights1, splits1), pair_token = self.arrived(sent)

        # Stage 2 (on the relay): one row per (destination rank in this node, row received).
        dest = expert1 // self.local_experts  # [A1] local rank owning each assignment
        received = len(rows1)
        keys, key_of = torch.unique(dest * received + row1, return_inverse=True)
        key_dest, key_row = keys // received, keys % received
        key_counts = _counts(key_dest, self.per_node)
        by_dest = torch.argsort(dest, stable=True)
        routing = torch.stack(
            [key_of - starts_of(key_counts)[dest], expert1 % self.local_experts], 1
        )[by_dest]
        # NOTE: waited for at once: the experts need these rows next.
        rows2, (row2, expert2, weights2, splits2) = self.wait_for(
            self._exchange(
                NODE,
                rows1[key_row],
                key_counts,
                routing.int(),
                weights1[by_dest],
                _counts(dest, self.per_node),
            )
        )

        # On the expert's rank: its assignments expert-major over the rows it received.
        by_expert = torch.argsort(expert2, stable=True)
        counts = _counts(expert2, self.local_experts)
        row_of = row2[by_expert]
        self._pending.append((splits1, pair_token, splits2, key_row, received, row_of, len(rows2)))
        return rows2, counts, row_of, weights2[by_expert]

    def combine(self, y_local: torch.Tensor, wait: bool) -> torch.Tensor:
        (send1, recv1), pair_token, (send2, recv2), key_row, received, row_of, rows = (
            self._pending.pop(0)
        )
        # The expert's rank sums its weighted assignments per row it received: [rows2, H]
        # (sum_rows: its backward keeps the index, not the summed rows).
        y_local = sum_rows(y_local, row_of, rows)
        y_keys = all_to_all(y_local, send2, recv2, self.handle, NODE, ROWS)  # [keys, H]
        # Sum inside the node: one row per (token, node) goes back across.
        y_rows = sum_rows(y_keys, key_row, received)
        # [pairs, H], in flight
        return self.start("ep.combine", pair_token, y_rows, send1, recv1, RAIL, ROWS, wait)

    def landed(self, rows, token_of, tokens):
        rows, pair_token = self.wait_for(rows)
        return rows, pair_token, tokens  # summed per (token, node): per token next
