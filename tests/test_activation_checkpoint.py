"""Activation checkpointing changes memory and time, never numbers or state (docs/overview.md,
"Principles").

`train.activation_checkpoint` = full and selective against none, on the same layout, fp32
on CPU, 3 steps: losses, aux and MTP losses, grad norms, every gradient and updated
parameter, the routers' biases and counts, and the expert-load metrics are bit-equal
(`==`, `torch.equal`). The math is the same op for op: a replay recomputes the dropped
activations with the same kernels on the same inputs, selective's kept outputs are the
forward's own tensors, and backward runs the forward's autograd graph, so there is no
exception to bitwise equality to explain.

Traffic: under selective the replay gets the all-to-all and ring outputs back without
running them, so `a2a_bytes` and ring operations equal none's; under full the replayed
forward dispatches and combines again, which adds exactly the forward's share: half of the
per-step bytes (summed over ranks: half of the expected bytes counted independently from
the routers' outputs, dispatch + combine, forward + backward; across simulated nodes the
forward's rows and routing, counted the same way), and 2(cp-1) ring operations per
attention call. Each mode's three runs share one spawn per layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.memory import peak_bytes
from moetrain.config import load_config
from moetrain.models import get_model_spec
from moetrain.models.common.moe import GroupLimitedRouter
from moetrain.parallelisms.activation_checkpoint import apply_activation_checkpointing
from moetrain.parallelisms.plan import match_modules
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, layout_worker

MODES = ("none", "full", "selective")
EP2, CP2 = "--parallel.ep=2", "--parallel.cp=2"
LOAD = "--metrics.expert_load_interval=1"  # the expert-load metric in every step's record
CASES = {  # name: (model, world, layout)
    "fsdp2": (TINY, 2, []),
    # LoRA: frozen base, adapters on attention and the routed experts (recomputed too).
    "ep2_efsdp2_lora": (TINY, 4, [EP2, "--peft.method=lora", "--peft.rank=4"]),
    "cp2_ep2": (TINY, 4, [CP2, EP2]),
    # MLA, group-limited routing with the bias update, the MTP module (a block of its own).
    "dsv3_mtp_ep2_efsdp2": (TINY_DSV3, 4, [EP2]),
    # ... with its experts over 2 simulated nodes of 2 ranks (the two-stage dispatch)
    "dsv3_mtp_ep4_2nodes": (TINY_DSV3, 4, ["--parallel.ep=4", "--parallel.ranks_per_node=2"]),
}


def _modes_worker(rank: int, world: int, argv: list[str], out_dir: str) -> None:
    """The three modes one after the other on the same ranks (one spawn per layout)."""
    for mode in MODES:
        mode_argv = [*argv, f"--train.activation_checkpoint={mode}"]
        layout_worker(rank, world, mode_argv, f"{out_dir}/{mode}.pt", None)


def _assert_same_state(ours: list[dict], ref: list[dict], mode: str) -> None:
    for step, (o, r) in enumerate(zip(ours, ref, strict=True), start=1):
        where = f"{mode}, step {step}"
        for key in ("loss", "aux_loss", "mtp_loss", "grad_norm", "expert_load", "tokens"):
            assert o.get(key) == r.get(key), f"{key} differs ({where})"
        for kind in ("grads", "params", "buffers"):
            assert o[kind].keys() == r[kind].keys()
            for name, tensor in r[kind].items():
                assert torch.equal(o[kind][name], tensor), f"{kind} {name} differs ({where})"
        assert ("bias_load" in o) == ("bias_load" in r)
        if "bias_load" in r:
            assert torch.equal(o["bias_load"], r["bias_load"]), f"bias load ({where})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_checkpointing_is_invisible(name, tmp_path):
    model, world, layout = CASES[name]
    run_distributed(_modes_worker, world, [*model, *layout, LOAD], str(tmp_path))
    runs = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in MODES}
    none = runs["none"]
    for mode in ("full", "selective"):
        _assert_same_state(runs[mode]["records"], none["records"], mode)

    if model is TINY_DSV3:  # the bias moved and the counts it used are real, in 3 routers
        load, bias = none["records"][-1]["bias_load"], none["records"][-1]["buffers"]
        assert load.shape[0] == 3 and (load.sum(1) > 0).all()
        assert all(b.abs().max() > 0 for n, b in bias.items() if n.endswith("correction_bias"))

    per_rank = {mode: runs[mode]["per_rank"] for mode in MODES}  # [rank][step] -> dict
    for step in range(len(none["records"])):
        sent = {m: [rank[step]["a2a_bytes"] for rank in per_rank[m]] for m in MODES}
        if not any(a.startswith("--parallel.ep=") for a in layout):
            assert all(b is None for m in MODES for b in sent[m])
            continue
        if "--parallel.ranks_per_node=2" in layout:  # two stages (tests/test_node_dispatch.py)
            across = {m: [rank[step]["a2a_internode_bytes"] for rank in per_rank[m]] for m in MODES}
            expected = sum(rank[step]["a2a_internode_expected"] for rank in per_rank["none"])
            forward = sum(rank[step]["a2a_internode_forward"] for rank in per_rank["none"])
            assert sent["selective"] == sent["none"] and across["selective"] == across["none"]
            assert sum(across["none"]) == expected > 0, f"step {step}"
            # full re-dispatches the forward's rows and routing (not half of the step: each
            # weight goes out in forward, only its gradient comes back)
            assert sum(across["full"]) == expected + forward, f"step {step}"
            continue
        # Forward and backward send the same over the ranks (the dispatch rows and weights
        # and the combine rows, then their gradients the other way; a rank's weights go out
        # in forward, those it received come back in backward): full's replayed forward
        # adds half of none's step.
        for rank in range(world):
            assert sent["selective"][rank] == sent["none"][rank], f"re-sent, rank {rank}"
        assert 2 * sum(sent["full"]) == 3 * sum(sent["none"]), f"step {step}"
        # Independently, from the routers' outputs (4 crossings of each remote assignment
        # per step, counted once per forward, not per replay: the same in every run).
        expected = [rank[step]["a2a_expected"] for rank in per_rank["none"]]
        assert all([r[step]["a2a_expected"] for r in per_rank[m]] == expected for m in MODES)
        assert sum(sent["none"]) == sum(expected) > 0, f"step {step}"
        assert sum(sent["selective"]) == sum(expected), f"step {step}"
        assert sum(sent["full"]) == sum(expected) + sum(expected) // 2, f"step {step}"
    if CP2 in layout:  # ring attention: cumulative point-to-point operations, per rank
        for rank in range(world):
            p2p = {mode: per_rank[mode][rank][-1]["p2p_ops"] for mode in MODES}
            # per attention call: forward 2(cp-1) = 2, backward 2(cp-1) + 2cp = 6
            assert p2p["none"] > 0 and p2p["selective"] == p2p["none"], f"rank {rank}"
            assert p2p["full"] == p2p["none"] + p2p["none"] * 2 // 8, f"rank {rank}"


# --- one process, no process group: the model with checkpointed blocks --------------------


def _forward_backward(model: nn.Module, argv: list[str]) -> dict:
    g = torch.Generator().manual_seed(1)
    args = load_config(argv).model.args
    ids = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    depth = getattr(args, "num_nextn_predict_layers", 0)
    mtp = torch.randint(0, args.vocab_size, (2, 32, depth), generator=g) if depth else None
    extra = {"mtp_input_ids": mtp} if depth else {}
    out = model(ids, **extra)
    loss = out.logits.logsumexp(-1).mean() + out.router_stats.prob_sum.square().mean()
    for logits in out.mtp_logits or []:
        loss = loss + logits.logsumexp(-1).mean()
    loss.backward()
    return {
        "loss": loss.detach(),
        "stats": out.router_stats.tokens_per_expert,
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
    }


def _model(argv: list[str], mode: str) -> nn.Module:
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.args)
    model.init_weights(cfg.train.seed)
    apply_activation_checkpointing(match_modules(model, spec.plan.blocks, "blocks"), mode)
    return model.train()


@pytest.mark.parametrize("argv", [TINY, TINY_DSV3], ids=["qwen3", "dsv3_mtp"])
def test_single_process_checkpointing_is_invisible(argv):
    ref = _forward_backward(_model(argv, "none"), argv)
    for mode in ("full", "selective"):
        model = _model(argv, mode)
        assert [n for n, _ in model.named_parameters()] == list(ref["grads"])  # same FQNs
        ours = _forward_backward(model, argv)
        assert torch.equal(ours["loss"], ref["loss"]) and torch.equal(ours["stats"], ref["stats"])
        for kind in ("grads", "buffers"):
            for name, tensor in ref[kind].items():
                assert torch.equal(ours[kind][name], tensor), f"{mode}: {kind} {name}"
        routers = [m for m in model.modules() if isinstance(m, GroupLimitedRouter)]
        for router in routers:  # each assignment counted once: 2 x 32 tokens, top-k each
            assert router.tokens_per_expert.sum() == 2 * 32 * router.top_k


def test_checkpointing_lowers_peak_memory():
    """Peak memory of one forward + backward (allocator events), debug Qwen3-MoE blocks."""
    argv = ["--config=configs/debug_qwen3_moe.toml"]
    peak = {}
    for mode in MODES:
        model = _model(argv, mode)
        peak[mode] = peak_bytes(lambda m=model: _forward_backward(m, argv))
    assert peak["full"] < peak["none"] and peak["selective"] < peak["none"], peak


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="activation_checkpoint"):
        apply_activation_checkpointing([], "sometimes")


@pytest.mark.parametrize("argv", [TINY, TINY_DSV3], ids=["qwen3", "dsv3"])
def test_selective_under_the_split_backward(argv):
    """The zero-bubble schedules' split backward (torch's `stage_backward_input`, then
    `stage_backward_weight`: two autograd passes over one graph) through `selective`
    blocks: the input pass rebuilds the attention's q, k, v, the weight pass the
    projections' inputs; every gradient equals the split backward's without recomputation
    bit for bit, and the plain backward's within fp32 summation order."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from moetrain.models.common.staged import default_positions, run_blocks

    def run(mode: str, split: bool) -> dict:
        model = _model(argv, mode)
        ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
        h0 = model.embed(ids).detach().requires_grad_()
        h, stats = run_blocks(
            model.layers, h0, model.block_inputs(h0, default_positions(ids), None)
        )
        loss = h.square().mean() + sum(s.prob_sum.square().mean() for s in stats)
        params = [p for p in model.layers.parameters() if p.requires_grad]
        if split:
            (dh,), groups = stage_backward_input([loss], None, [h0], iter(params))
            stage_backward_weight(iter(params), groups)
        else:
            loss.backward()
            dh = h0.grad
        named = {n: p.grad for n, p in model.layers.named_parameters()}
        assert all(g is not None for g in named.values())
        return {"input": dh, **named}

    plain, split = run("none", split=False), run("none", split=True)
    ours = run("selective", split=True)
    for name, grad in split.items():
        assert torch.equal(ours[name], grad), name
        torch.testing.assert_close(ours[name], plain[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("config", ["debug_qwen3_moe", "debug_deepseek_v3"])
def test_planner_block_bytes_match_the_allocator(config):
    """What a block's forward leaves for its backward, per mode: the planner's activation
    model (the meta trace, `StepTrace.saved_by_structure`) against the CPU allocator's
    events (benchmarks/memory.py `block_activation_bytes`), within 5%; and `selective`
    keeps less than `none` (the debug configs, one micro-batch of 4 x 128, fp32)."""
    from benchmarks.memory import block_activation_bytes
    from moetrain.models.common.moe import MoEOptions
    from moetrain.planner.activation_trace import block_structure, trace_step
    from moetrain.planner.meta_trace import use_fused_attention

    argv = [f"--config=configs/{config}.toml", "--train.device=cpu"]
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    measured = {}
    for mode in ("none", "selective"):
        with torch.device("meta"):
            model = spec.build(cfg.model.args, MoEOptions(gemm="grouped_mm")).train()
        use_fused_attention(model, spec.plan)
        blocks = match_modules(model, spec.plan.blocks, "blocks")
        apply_activation_checkpointing(blocks, mode)
        B, S = cfg.train.micro_batch_size, cfg.data.seq_len
        ids = torch.zeros(B, S, dtype=torch.long, device="meta")
        depth = getattr(cfg.model.args, "num_nextn_predict_layers", 0)
        extra = {"mtp_input_ids": ids[..., None].expand(B, S, depth)} if depth else {}

        def run_step(mark, model=model, ids=ids, extra=extra):
            out = model(ids, **extra)
            mark()
            out.logits.sum().backward()

        planned = trace_step(model, spec.plan, run_step, 0).saved_by_structure
        measured[mode] = block_activation_bytes(argv, mode)
        for fqn, block in blocks:
            ratio = planned[block_structure(block)] / measured[mode][fqn]
            assert abs(ratio - 1) <= 0.05, (mode, fqn, ratio)
    assert all(measured["selective"][f] < 0.8 * measured["none"][f] for f in measured["none"])


def test_block_bytes_ignore_what_an_earlier_measurement_frees_during_this_one():
    """`block_activation_bytes` gives the same figures whatever ran before it in the process:
    a tensor an earlier profiled measurement allocated, freed inside a block's forward
    window, is not this block's memory (the allocator's reporter remembers its size for the
    whole process; before, the block's figure dropped by its 16 MiB)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.memory import block_activation_bytes

    argv = ["--config=configs/debug_qwen3_moe.toml", "--train.device=cpu"]
    fresh = block_activation_bytes(argv, "full")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        leftover = [torch.empty(2**22)]  # an earlier measurement's tensor, still alive

    def free_in_the_first_block(module, args, output) -> None:
        if isinstance(module, nn.Linear) and leftover:  # the first block's first projection
            leftover.clear()

    hook = nn.modules.module.register_module_forward_hook(free_in_the_first_block)
    try:
        again = block_activation_bytes(argv, "full")
    finally:
        hook.remove()
    assert not leftover  # it was freed while the blocks ran
    assert again == fresh and min(fresh.values()) > 0


def test_selective_keeps_no_expert_output_for_the_routing_weights():
    """Qwen3-MoE debug on the meta trace (the planner's, held to the allocator above): under
    `selective` a MoE block keeps less, by its experts' output rows (top-k x dim a token,
    fp32), than with the down-projection outside the recomputed regions, as it was."""
    from moetrain.models.common.mlp import swiglu
    from moetrain.models.common.moe import GroupedExperts, MoEOptions
    from moetrain.models.common.recompute import recomputed
    from moetrain.planner.activation_trace import block_structure, trace_step
    from moetrain.planner.meta_trace import use_fused_attention

    class KeptDown(GroupedExperts):  # the former arithmetic: only SwiGLU's product rebuilt
        def ffn(self, x_sorted, tokens_per_expert):
            gate, up = self.project(x_sorted, "gate_up", tokens_per_expert).chunk(2, dim=-1)
            return self.project(recomputed(swiglu, gate, up), "down", tokens_per_expert)

    cfg = load_config(["--config=configs/debug_qwen3_moe.toml"])
    spec, args = get_model_spec(cfg.model.name), cfg.model.args
    B, S = cfg.train.micro_batch_size, cfg.data.seq_len
    saved = {}
    for variant in ("rebuilt", "kept"):
        with torch.device("meta"):
            model = spec.build(args, MoEOptions(gemm="grouped_mm")).train()
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        for m in experts if variant == "kept" else ():
            m.__class__ = KeptDown
        use_fused_attention(model, spec.plan)
        blocks = match_modules(model, spec.plan.blocks, "blocks")
        apply_activation_checkpointing(blocks, "selective")
        ids = torch.zeros(B, S, dtype=torch.long, device="meta")

        def run_step(mark, model=model, ids=ids):
            out = model(ids)
            mark()
            out.logits.sum().backward()

        by_structure = trace_step(model, spec.plan, run_step, 0).saved_by_structure
        moe = [b for _, b in blocks if any(isinstance(m, GroupedExperts) for m in b.modules())]
        saved[variant] = by_structure[block_structure(moe[0])]
    rows = B * S * args.num_experts_per_tok * args.hidden_size * 4
    # (less the down-projection region's one kept input of its own: the [E] int64 counts)
    counts = args.num_experts * 8
    assert saved["kept"] - saved["rebuilt"] == rows - counts > 0, (saved, rows)
