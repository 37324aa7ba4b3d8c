"""Node-aware (two-stage) expert dispatch: one MoE layer on 4 real ranks split into simulated
nodes, against the same layer on one process and against the flat all-to-all; its
inter-node bytes against an independent count of (token, remote node) pairs; node-limited
routing from group-limited routing; the layouts it refuses. The full training runs are rows
of tests/test_layout_parity.py (dsv3_ep4_2nodes, hsdp2x2_ep2_1rank_nodes)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moetrain.models.common.moe import GroupLimitedRouter, MoE
from moetrain.parallelisms.all_to_all import Traffic
from moetrain.parallelisms.dims import LayoutError, ParallelDims
from moetrain.parallelisms.expert_parallel import apply_expert_parallel
from moetrain.parallelisms.node_dispatch import NodeDispatcher
from tests.distributed import run_distributed

HIDDEN, TOKENS, EXPERTS, TOP_K, GROUPS, TOPK_GROUP = 16, 24, 16, 4, 8, 2


def _layer() -> MoE:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    router = GroupLimitedRouter(HIDDEN, EXPERTS, TOP_K, GROUPS, TOPK_GROUP, True, 2.5)
    layer = MoE(HIDDEN, 8, router)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _skew(_router, _inputs, out):
    """Every token to experts 0..3: all on ep rank 0, so node 1's relays and ranks 1..3
    receive nothing (a routing no load balancer would allow)."""
    return out._replace(top_experts=out.top_experts % TOP_K)


def _grads(layer: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and every gradient of sum(y^2) over x [B, T, H] (full tensors)."""
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    y.square().sum().backward()
    out = {"y": y.detach(), "x": x.grad}
    for name, p in layer.named_parameters():
        out[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return out


def _worker(rank: int, world: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    x_all = torch.randn(world, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    x = x_all[rank : rank + 1]
    ref = _grads(_layer(), x_all)  # one process, every rank's tokens
    with torch.no_grad():
        top = (
            _layer().gate(x[0]).top_experts
        )  # [T, k] this rank's routing, as the layers will see it
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    row = HIDDEN * 4  # fp32
    results = {}
    for nodes in (2, 4):
        per_node = world // nodes
        split = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("rail", "node"))
        node_of = top // (EXPERTS // nodes)  # [T, k]
        my_node = rank // per_node
        remote_pairs = sum(len(set(t) - {my_node}) for t in node_of.tolist())
        remote_assignments = int((node_of != my_node).sum())
        for kind in ("flat", "two_stage"):
            layer = _layer()
            meshes = (split["rail"], split["node"]) if kind == "two_stage" else None
            dispatcher = apply_expert_parallel(
                (layer.permute, layer.experts, layer.unpermute), ep_mesh, per_node, meshes
            )
            x_local = x.clone().requires_grad_()
            y, _ = layer(x_local)
            forward = dispatcher.reset_traffic()
            y.square().sum().backward()
            backward = dispatcher.reset_traffic()
            got = {"y": y.detach(), "x": x_local.grad}
            for name, p in layer.named_parameters():
                g = p.grad
                if isinstance(g, DTensor):
                    g = g.full_tensor()
                else:  # the replicated router: each rank holds its tokens' share
                    dist.all_reduce(g)
                got[name] = g
            mine = {"y": ref["y"][rank : rank + 1], "x": ref["x"][rank : rank + 1]}
            errors = {k: ((v - {**ref, **mine}[k]).abs().max() / ref[k].abs().max()).item()
                      for k, v in got.items()}  # fmt: skip
            results[(nodes, kind)] = {
                "errors": errors,
                "two_stage": isinstance(dispatcher, NodeDispatcher),
                "forward": tuple(forward),  # Traffic (sent, internode, internode_routing)
                "backward": tuple(backward),
                "pairs_bytes": 2 * remote_pairs * row,  # dispatch + combine
                "assignments_bytes": 2 * remote_assignments * row,
                "routing_bytes": (12 * remote_assignments, 4 * remote_assignments),
                "nodes_per_token": int(max(len(set(t)) for t in node_of.tolist())),
            }
    # Skewed: the two-stage dispatch with empty chunks, relays and expert ranks.
    reference, layer = _layer(), _layer()
    for m in (reference, layer):
        m.gate.register_forward_hook(_skew)
    want = _grads(reference, x_all)
    split = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rail", "node"))
    apply_expert_parallel(
        (layer.permute, layer.experts, layer.unpermute), ep_mesh, 2, (split["rail"], split["node"])
    )
    got = _grads(layer, x)
    mine = {k: want[k][rank : rank + 1] for k in ("y", "x")}
    experts = ("experts.gate_up_proj", "experts.down_proj")  # full tensors: every rank's tokens
    results["skewed"] = max(
        ((got[k] - {**want, **mine}[k]).abs().max() / want[k].abs().max()).item()
        for k in ("y", "x", *experts)
    )
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)


@pytest.mark.slow
def test_two_stage_dispatch_matches_one_process_and_sends_each_token_once_per_node(tmp_path):
    run_distributed(_worker, 4, str(tmp_path / "out.pt"))
    per_rank = torch.load(tmp_path / "out.pt")
    assert all(results.pop("skewed") < 1e-5 for results in per_rank)
    for nodes, kind in per_rank[0]:
        where = f"{nodes} nodes, {kind}"
        runs = [results[(nodes, kind)] for results in per_rank]
        for run in runs:
            assert max(run["errors"].values()) < 1e-5, (where, run["errors"])
            assert run["two_stage"] == (kind == "two_stage"), where
            # node-limited routing: the groups line up with the nodes (8 groups, 2 or 4 nodes)
            assert run["nodes_per_token"] <= TOPK_GROUP, where
        # Summed over the ranks: a rank's combine sends back rows that others dispatched.
        traffic = {d: [Traffic(*run[d]) for run in runs] for d in ("forward", "backward")}
        pairs = sum(run["pairs_bytes"] for run in runs)
        assignments = sum(run["assignments_bytes"] for run in runs)
        for direction, sent in traffic.items():
            # flat: one row per (token, expert on another node), out and back; two-stage: one
            # row per (token, other node), however many of its experts sit there
            expected = assignments if kind == "flat" else pairs
            assert sum(t.internode for t in sent) == expected, (where, direction)
        routing = [sum(t.internode_routing for t in traffic[d]) for d in traffic]
        if kind == "flat":  # each remote assignment's weight out, its gradient back
            weights = sum(run["routing_bytes"][1] for run in runs)  # 4 bytes each
            assert routing == [weights, weights], where
        else:  # each remote assignment's expert, row and weight out; the weight's gradient back
            assert routing == [sum(run["routing_bytes"][i] for run in runs) for i in (0, 1)]
            assert 0 < pairs < assignments, where  # some token had two experts on a node


def test_group_limited_routing_reaches_at_most_topk_group_nodes_when_nodes_divide_groups():
    """Experts are laid out by index and a group is a run of experts: when the nodes divide
    the groups, each node holds whole groups, and a token's `topk_group` groups reach at
    most `topk_group` nodes. When groups straddle nodes, the bound is gone."""
    torch.manual_seed(0)
    experts, groups, topk_group = 64, 8, 2
    router = GroupLimitedRouter(32, experts, 8, groups, topk_group, True, 1.0)
    torch.nn.init.normal_(router.weight, std=0.1)
    with torch.no_grad():
        top = router(torch.randn(2048, 32)).top_experts  # [T, 8]

    def most_nodes(nodes: int) -> int:
        node_of = top // (experts // nodes)
        reached = torch.zeros(len(top), nodes, dtype=torch.bool).scatter_(1, node_of, True)
        return int(reached.sum(1).max())

    for nodes in (2, 4, 8):
        assert most_nodes(nodes) <= topk_group
    assert most_nodes(16) > topk_group  # 16 nodes: each group over two nodes


@pytest.mark.parametrize(
    "ep,world,ranks_per_node,env,match",
    [
        (4, 8, 3, None, "parallel.ranks_per_node = 3 does not divide the world size 8"),
        (4, 12, 6, None, "an expert-parallel group must fit inside one node"),
        (4, 12, 0, "6", "torchrun's LOCAL_WORLD_SIZE"),
    ],
)
def test_ep_groups_that_straddle_nodes_are_refused(
    ep, world, ranks_per_node, env, match, monkeypatch
):
    if env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    with pytest.raises(LayoutError, match=match):
        ParallelDims.resolve(1, -1, 1, ep, world, ranks_per_node)


def test_ep_nodes_follow_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ParallelDims.resolve(1, -1, 1, 8, 16).ep_nodes == 1  # ep inside a node: flat
    assert ParallelDims.resolve(1, -1, 1, 16, 16).ep_nodes == 2  # from LOCAL_WORLD_SIZE
    assert ParallelDims.resolve(1, -1, 1, 16, 16, ranks_per_node=4).ep_nodes == 4
