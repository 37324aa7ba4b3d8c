"""The expert all-to-all in the step-time model (`moetrain.planner.step_cost`): its seconds on
the links it crosses, and what of it `parallel.ep_overlap` runs under compute."""

from __future__ import annotations

from math import comb

from moetrain.planner.hardware import GB, Hardware


def node_share(
    experts: int, top_k: int, nodes: int, groups: tuple[int, int] | None = None
) -> float:
    """(token, remote node) pairs per remote (token, expert) assignment when each token takes
    `top_k` of `experts` uniformly at random, spread evenly over `nodes` nodes: a node is
    reached unless all k experts miss it, so nodes * P(reached) / k.

    `groups` (expert groups, groups per token: the spec's `routing_groups`): a token's
    experts come from that many groups, each a run of consecutive experts; where whole
    groups sit on each node (nodes divide the groups), a node is reached unless all the
    token's groups miss it, taken uniformly among the groups (DeepSeek-V3 over 8 nodes: 4
    of 8 groups, one per node, so 4 nodes of 8 experts: 0.5). Otherwise, uniform routing."""
    if groups is not None and groups[0] % nodes == 0:
        g, per_token = groups
        missed = comb(g - g // nodes, per_token) / comb(g, per_token)
    else:
        missed = comb(experts - experts // nodes, top_k) / comb(experts, top_k)
    return nodes * (1 - missed) / top_k


def overlap_shares(flops_per_token: float, by_kind_s: dict | None) -> tuple[float, float]:
    """(routed experts, shared experts): their shares of the compute time (of the FLOPs,
    or with measured rates of the time by kind; the shared experts run at the dense rate)."""
    split = getattr(flops_per_token, "by_kind", None)
    if not split:
        return 0.0, 0.0
    shared = getattr(flops_per_token, "shared_experts", 0.0)
    if by_kind_s is None:
        return split["grouped"] / flops_per_token, shared / flops_per_token
    total = sum(by_kind_s.values())
    dense = by_kind_s["dense"] * shared / split["dense"] if split["dense"] else 0.0
    return by_kind_s["grouped"] / total, dense / total


def a2a_hidden(form: str, pass_s: float, experts_s: float, shared_s: float) -> float:
    """Seconds of one pass's expert all-to-all (`pass_s`: dispatch and combine, half each,
    of every MoE layer; a forward, or a backward's gradients) that run under compute with
    `parallel.ep_overlap` `form`; `experts_s`, `shared_s`: the routed and the shared
    experts' compute in that pass.

    NOTE: the rule, per layer (layers alike, so it holds for their sums): a transfer hides
    under the compute that runs between its issue and its wait, up to that compute's time.
    - shared: the combine (pass/2) under the shared experts (backward: its gradient under
      their backward);
    - chunks, halves A and B: B's dispatch (pass/4) under A's experts (experts/2), the two
      combines (pass/2) under B's experts and the shared ones; A's dispatch is exposed.
      The backward mirrors it with the same sums (B's dispatch gradient under A's experts'
      backward, the combines' gradients under the shared experts' and B's);
    - none: nothing hides.
    Not modelled: that hidden transfers slow the compute they run under (NCCL's kernels
    take SMs) or share links with FSDP's, whose traffic hides under the same compute.
    """
    if form == "shared":
        return min(pass_s / 2, shared_s)
    if form == "chunks":
        return min(pass_s / 4, experts_s / 2) + min(pass_s / 2, experts_s / 2 + shared_s)
    return 0.0


def a2a_seconds(a2a: float, layout, hw: Hardware) -> tuple[float, float]:
    """(seconds, the share of remote rows that cross nodes) of `a2a` all-to-all bytes."""
    ep = layout.dims.ep
    if ep <= hw.ranks_per_node:
        return a2a / (hw.intra_gbps * GB), 1.0
    remote = (ep - hw.ranks_per_node) / (ep - 1)  # of the ep - 1 peers a row may go to
    share = node_share(layout.experts, layout.top_k, ep // hw.ranks_per_node, layout.routing_groups)
    across = a2a * remote * share  # two stages: each (token, remote node) row once
    # NOTE: stage 2's split sizes come from stage 1's output (a host read), so the two
    # stages run one after the other: their times add up.
    inside = (a2a * (1 - remote) + across) / (hw.intra_gbps * GB)
    return inside + across / (hw.inter_gbps * GB), share
