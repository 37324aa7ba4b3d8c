"""What node-aware expert dispatch would save: inter-node bytes of today's flat all-to-all
against sending each token across once per destination node (counts, no processes).

    python benchmarks/node_dispatch.py [--tokens 8192] [--nodes 4] [--ranks-per-node 8]
        [--experts 256] [--top-k 8] [--groups 8] [--topk-group 4] [--hidden 7168] [--json FILE]

Routing is DeepSeek-V3's (`models.common.moe.GroupLimitedRouter`: sigmoid affinities,
the best `topk_group` of `groups` expert groups, top-k inside them) with random weights on
random tokens of one source rank. Experts are laid out as expert parallelism lays them
(expert e on rank e // (experts / ep), ranks numbered node-major). Per dispatch (forward; the
combine and backward repeat the same volume), the bytes leaving the source node:

- flat: one row per (token, expert) assignment whose expert sits on another node (today:
  the all-to-all sends each assignment's row to its expert's rank);
- node-aware: one row per (token, destination node) pair with any of its experts there (a
  token crosses once per node, then fans out over NVLink), counted from the routing alone.

When the nodes divide the groups, each node holds whole groups (experts are laid out by
index), so a token reaches at most `topk_group` nodes: DeepSeek-V3's node-limited routing
falls out of group-limited routing (see --nodes 8 --ranks-per-node 4: one group a node).
Prints one JSON object (or writes --json FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from report import write_result  # noqa: E402

from models.common.moe import GroupLimitedRouter  # noqa: E402


def routing(args) -> torch.Tensor:
    """top_experts [T, k] of one rank's tokens."""
    torch.manual_seed(0)
    router = GroupLimitedRouter(256, args.experts, args.top_k, args.groups, args.topk_group,
                                True, 1.0)  # fmt: skip
    torch.nn.init.normal_(router.weight, std=0.05)
    with torch.no_grad():
        _, _, top = router(torch.randn(args.tokens, 256))
    return top


def count(top: torch.Tensor, args, node_of_expert: torch.Tensor, source_node: int) -> dict:
    nodes = node_of_expert[top]  # [T, k]: the node of each assignment's expert
    remote = nodes != source_node
    per_token = torch.zeros(top.shape[0], args.nodes, dtype=torch.bool)
    per_token.scatter_(1, nodes, True)
    pairs = per_token.clone()
    pairs[:, source_node] = False  # the own node is reached without crossing
    row = args.hidden * 2  # bf16
    flat, aware = int(remote.sum()) * row, int(pairs.sum()) * row
    return {
        "flat_inter_node_bytes": flat,
        "node_aware_inter_node_bytes": aware,
        "saving": 1 - aware / flat if flat else 0.0,
        "nodes_per_token_mean": float(per_token.sum(1).float().mean()),
        "nodes_per_token_max": int(per_token.sum(1).max()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("tokens", 8192), ("nodes", 4), ("ranks-per-node", 8), ("experts", 256),
                          ("top-k", 8), ("groups", 8), ("topk-group", 4), ("hidden", 7168)):  # fmt: skip
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ep = args.nodes * args.ranks_per_node
    if args.experts % ep or args.experts % args.groups:
        raise SystemExit("--experts must divide over the ranks and the groups")
    top = routing(args)
    rank_of_expert = torch.arange(args.experts) // (args.experts // ep)
    by_rank = count(top, args, rank_of_expert // args.ranks_per_node, source_node=0)
    result = {"settings": vars(args), "experts_by_rank": by_rank}
    # Experts are laid out by index and a group is a run of experts, so when the nodes
    # divide the groups each node holds whole groups: a token's `topk_group` groups then
    # span at most `topk_group` nodes (node-limited routing, from group-limited routing).
    result["groups_whole_on_nodes"] = args.groups % args.nodes == 0
    r = by_rank
    result["summary"] = (
        f"{args.tokens} tokens, top-{args.top_k} of {args.experts} experts in {args.groups} groups "
        f"(best {args.topk_group}), {args.nodes} nodes x {args.ranks_per_node}: inter-node "
        f"bytes per dispatch {r['flat_inter_node_bytes'] / 2**20:.1f} MiB flat -> "
        f"{r['node_aware_inter_node_bytes'] / 2**20:.1f} MiB node-aware "
        f"({100 * r['saving']:.0f}% less); a token reaches {r['nodes_per_token_mean']:.2f} nodes "
        f"on average, at most {r['nodes_per_token_max']}"
    )
    write_result(result, args.json)
    print(result["summary"])


if __name__ == "__main__":
    main()
