"""What node-aware expert dispatch would save: inter-node bytes of today's flat all-to-all
against sending each token across once per destination node (counts, no processes).

    python benchmarks/node_dispatch.py [--tokens 8192] [--nodes 4] [--ranks-per-node 8]
        [--experts 256] [--top-k 8] [--groups 8] [--topk-group 4] [--hidden 7168] [--json FILE]

Routing is DeepSeek-V3's (`moetrain.models.common.moe.GroupLimitedRouter`: sigmoid affinities,
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

    python benchmarks/node_dispatch.py --measure --ranks-per-node 2 [--nodes 4]

runs the dispatchers themselves: nodes x ranks-per-node CPU processes (gloo), each with
--tokens-per-rank tokens (default 512) through one MoE layer of that routing (hidden 64,
fp32), forward and backward, once with today's flat all-to-all and once with the two-stage
dispatch (moetrain/parallelisms/node_dispatch.py). It reports the inter-node bytes each dispatcher
counted, summed over the ranks, next to the count of remote (token, expert) assignments and
(token, node) pairs from the routers' outputs, and scales the rows to bf16 rows of --hidden.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from report import write_result  # noqa: E402

from moetrain.models.common.moe import GroupLimitedRouter  # noqa: E402


def routing(args) -> torch.Tensor:
    """top_experts [T, k] of one rank's tokens."""
    torch.manual_seed(0)
    router = GroupLimitedRouter(256, args.experts, args.top_k, args.groups, args.topk_group,
                                True, 1.0)  # fmt: skip
    torch.nn.init.normal_(router.weight, std=0.05)
    with torch.no_grad():
        return router(torch.randn(args.tokens, 256)).top_experts


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


MEASURE_HIDDEN = 64  # the measured layer's width (fp32 rows); bytes are scaled to --hidden


def _measure_worker(rank: int, world: int, args, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.models.common.moe import MoE
    from moetrain.parallelisms.expert_parallel import apply_expert_parallel

    dist.init_process_group("gloo")
    per_node = args.ranks_per_node
    x = torch.randn(1, args.tokens_per_rank, MEASURE_HIDDEN,
                    generator=torch.Generator().manual_seed(rank))  # fmt: skip
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    split = init_device_mesh("cpu", (args.nodes, per_node), mesh_dim_names=("rail", "node"))
    result = {}
    for kind, meshes in (("flat", None), ("two_stage", (split["rail"], split["node"]))):
        torch.manual_seed(0)  # the same layer on every rank and for both dispatchers
        router = GroupLimitedRouter(MEASURE_HIDDEN, args.experts, args.top_k, args.groups,
                                    args.topk_group, True, 2.5)  # fmt: skip
        layer = MoE(MEASURE_HIDDEN, 32, router)
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.05)
        dispatcher = apply_expert_parallel(
            (layer.permute, layer.experts, layer.unpermute), ep_mesh, per_node, meshes
        )
        with torch.no_grad():
            top = layer.gate(x[0]).top_experts  # [T, k] the routing the layer will use
        y, _ = layer(x.clone().requires_grad_())  # activations carry gradients
        y.square().sum().backward()
        result[kind] = tuple(dispatcher.reset_traffic())  # (sent, internode, routing)
    node_of = top // (args.experts // args.nodes)  # [T, k]
    mine = rank // per_node
    reached = torch.zeros(len(node_of), args.nodes, dtype=torch.bool).scatter_(1, node_of, True)
    result["remote_assignments"] = int((node_of != mine).sum())
    result["remote_pairs"] = int(reached.sum()) - int(reached[:, mine].sum())
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out_path)


def measure(args) -> dict:
    import tempfile

    from tests.distributed import run_distributed

    world = args.nodes * args.ranks_per_node
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_measure_worker, world, args, f"{tmp}/out.pt")
        per_rank = torch.load(f"{tmp}/out.pt")
    row, scaled = MEASURE_HIDDEN * 4, args.hidden * 2
    out = {}
    for kind in ("flat", "two_stage"):
        internode = sum(r[kind][1] for r in per_rank)  # Traffic.internode, all ranks
        # forward + backward, each with dispatch and combine: 4 crossings per row
        rows_per_dispatch = internode // (4 * row)
        out[kind] = {
            "internode_rows_per_dispatch": rows_per_dispatch,
            "internode_routing_bytes_per_step": sum(r[kind][2] for r in per_rank),
            "internode_bytes_per_dispatch_at_hidden": rows_per_dispatch * scaled,
        }
    out["counted_remote_assignments"] = sum(r["remote_assignments"] for r in per_rank)
    out["counted_remote_pairs"] = sum(r["remote_pairs"] for r in per_rank)
    out["flat_matches_count"] = (
        out["flat"]["internode_rows_per_dispatch"] == out["counted_remote_assignments"]
    )
    out["two_stage_matches_count"] = (
        out["two_stage"]["internode_rows_per_dispatch"] == out["counted_remote_pairs"]
    )
    flat, two = (out[k]["internode_rows_per_dispatch"] for k in ("flat", "two_stage"))
    out["saving"] = 1 - two / flat if flat else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("tokens", 8192), ("nodes", 4), ("ranks-per-node", 8), ("experts", 256),
                          ("top-k", 8), ("groups", 8), ("topk-group", 4), ("hidden", 7168),
                          ("tokens-per-rank", 512)):  # fmt: skip
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--measure", action="store_true", help="run the dispatchers on CPU ranks")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ep = args.nodes * args.ranks_per_node
    if args.experts % ep or args.experts % args.groups:
        raise SystemExit("--experts must divide over the ranks and the groups")
    if args.measure:
        m = measure(args)
        m["settings"] = vars(args)
        m["summary"] = (
            f"measured on {args.nodes} simulated nodes x {args.ranks_per_node} CPU ranks, "
            f"{args.tokens_per_rank} tokens each, top-{args.top_k} of {args.experts} experts in "
            f"{args.groups} groups (best {args.topk_group}): inter-node rows per dispatch "
            f"{m['flat']['internode_rows_per_dispatch']} flat -> "
            f"{m['two_stage']['internode_rows_per_dispatch']} two-stage "
            f"({100 * m['saving']:.0f}% less; each equal to the routers' own count: "
            f"{m['flat_matches_count'] and m['two_stage_matches_count']}); routing sent across "
            f"{m['two_stage']['internode_routing_bytes_per_step'] / 2**10:.0f} KiB per step"
        )
        write_result(m, args.json)
        print(m["summary"])
        return
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
