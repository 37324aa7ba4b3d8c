"""The planner's figures on hand-computed values: the model's parameter counts (issue 55),
and the step-time model's corrections of issue 57 (the MTP head's FLOPs, the per-rank
split of V stages, the node share of a group-limited router, named link rates, the
optimizer step's time, the interleaved refusal, the V schedules in the search)."""

from __future__ import annotations

import json
import os

import pytest

from tests.test_dry_run import CONFIG


def test_the_planner_prints_total_and_active_parameters(capsys, tmp_path):
    """Qwen3-MoE debug (configs/debug_qwen3_moe.toml), counted by hand from its config:
    hidden 128, vocab 320 (embedding and head apart), 4 blocks (block 0 dense), 4 heads of
    32, 2 KV heads, 8 experts of 64, top 2."""
    from moetrain.planner.cli import main

    h, vocab, hd = 128, 320, 32
    attention = h * 4 * hd * 2 + h * 2 * hd * 2 + 2 * hd + 2 * h  # q, o; k, v; q/k norms; 2 norms
    dense = 3 * h * 256
    experts = 8 * 3 * h * 64
    router = h * 8
    total = 2 * vocab * h + h + 4 * attention + dense + 3 * (router + experts)
    active = total - 3 * experts * 6 // 8  # of each MoE layer's 8 experts, 6 unused
    out = tmp_path / "plan.json"
    assert main(["--world-size=2", "--config", CONFIG, f"--json={out}"]) == 0
    printed = capsys.readouterr().out
    assert (total, active) == (971_136, 528_768)
    assert f"parameters: {total:,} total, {active:,} active per token" in printed
    assert json.loads(out.read_text())["parameters"] == {"total": total, "active": active}


DSV3 = os.path.join(os.path.dirname(CONFIG), "debug_deepseek_v3.toml")


def test_the_mtp_module_is_counted_apart_from_the_main_model():
    """DeepSeek-V3 debug's MTP depth, counted by hand (hidden 128, 4 heads, q rank 64, kv
    rank 32, nope 32, rope 16, v 24; 8 experts of 64, top 2, one shared expert of 64): its
    own norms (enorm, hnorm, norm, the block's two) and eh_proj [2h -> h], the block's MLA
    and MoE. The main model is the rest (published counts are the main model's: the full
    config gives 671.0B total, 37.6B active, benchmarks/deepseek_v3_published.py; DeepSeek
    states 671B and 37B)."""
    from moetrain.config import load_config
    from moetrain.planner.model_counts import parameter_counts
    from moetrain.planner.report import parameters_line

    h, heads = 128, 4
    norms = 5 * h + 64 + 32  # and the q and kv latents' norms
    attention = (
        64 * h + heads * (32 + 16) * 64 + (32 + 16) * h + heads * (32 + 24) * 32 + h * heads * 24
    )
    experts, shared, router = 8 * (h * 2 * 64 + 64 * h), 3 * 64 * h, 8 * h
    mtp = norms + 2 * h * h + attention + router + experts + shared
    mtp_active = mtp - experts * 6 // 8
    counts = parameter_counts(load_config(["--config", DSV3]))
    assert (mtp, mtp_active) == (301_792, 154_336)
    assert counts["mtp"] == {"total": mtp, "active": mtp_active}
    main = {"total": counts["total"] - mtp, "active": counts["active"] - mtp_active}
    assert counts["main"] == main
    assert parameters_line(counts).startswith(
        f"parameters: main model {main['total']:,} (1.0M) total, {main['active']:,} active per "
        f"token (each routed expert at top_k / experts); MTP module {mtp:,} total, "
        f"{mtp_active:,} active"
    )
    assert "mtp" not in parameter_counts(load_config(["--config", CONFIG]))  # Qwen3-MoE: none


def test_mtp_depths_pass_through_the_shared_head_again():
    """DeepSeek-V3 debug (vocab 320, hidden 128, one MTP depth, an untied head): the model's
    count carries one more pass through the 320 x 128 head than 6 x its active parameters,
    and pipeline stages give it to the last stage (issue 57, correction 2)."""
    import torch

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.models.common.flops import training_flops_per_token
    from moetrain.parallelisms.pipeline_split import stage_costs

    cfg = load_config(["--config", DSV3])
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
    a, seq = model.args, cfg.data.seq_len
    assert a.num_nextn_predict_layers == 1 and model.lm_head is not None
    plain = training_flops_per_token(
        model, seq, attention_layers=a.num_hidden_layers + 1, heads=a.num_attention_heads,
        qk_dim=a.qk_head_dim, v_dim=a.v_head_dim, input_embedding=model.embed_tokens,
    )  # fmt: skip
    total = spec.flops_per_token(model, seq)
    head_pass = 6 * 320 * 128
    assert float(total) - float(plain) == head_pass
    assert total.by_kind["dense"] - plain.by_kind["dense"] == head_pass
    attention = total.by_kind["attention"]
    modules_only = stage_costs(model, spec.plan, attention).last
    assert stage_costs(model, spec.plan, attention, total).last == modules_only + head_pass


def test_the_interleaved_refusal_names_counts_that_run():
    """Torch runs Interleaved1F1B in n // pp rounds, whose number must divide n: 120 on 16
    ranks is 7 rounds, which do not; any multiple of 16 runs (issue 57, correction 7)."""
    from moetrain.parallelisms.dims import pipeline_micro_batches_needed

    need = pipeline_micro_batches_needed("Interleaved1F1B", 16, 120)
    assert "(7 rounds for 120, which they do not divide): e.g. 112 or 128" in need
    assert pipeline_micro_batches_needed("Interleaved1F1B", 16, 112) is None
    assert pipeline_micro_batches_needed("Interleaved1F1B", 16, 128) is None


def test_the_interleaved_refusal_at_deepseeks_scale_suggests_batches_that_run(capsys):
    """DeepSeek-V3 on 2,048 ranks, pp 16 x 128 data-parallel ranks, global batch 15,360: 120
    micro-batches a rank. The refusal names the global batches of the nearest counts that
    run, 112 x 128 = 14,336 and 128 x 128 = 16,384 (it named 2,048 = 16 x 128 before, an
    eighth of the batch); the check passes each of them."""
    from moetrain.parallelisms.dims import LayoutError, check_pipeline
    from moetrain.planner.cli import main

    config = os.path.join(os.path.dirname(CONFIG), "deepseek_v3_671b.toml")
    pp = ["--parallel.pp=16", "--parallel.ep=64", "--parallel.pp_schedule=Interleaved1F1B"]
    argv = ["--world-size=2048", "--config", config, *pp]
    assert main([*argv, "--train.global_batch_size=15360"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        "e.g. use train.global_batch_size=14336 (112 micro-batches) or 16384 (128 micro-batches)"
    )
    for batch in (14336, 16384):
        check_pipeline(16, "Interleaved1F1B", 2, batch // 128, batch)  # runs: no refusal
    with pytest.raises(LayoutError, match=r"at least 32 .* runs 8 .*size=4096 \(32 micro-"):
        check_pipeline(16, "DualPipeV", 2, 8, 1024)  # below the least: the least alone


def test_a_group_limited_router_reaches_fewer_nodes():
    """DeepSeek-V3 over 8 nodes (ep 64): 256 experts in 8 groups, a token's 8 experts from 4
    of them. One group per node: 4 nodes reached of 8 experts, 0.5 crossing rows per remote
    assignment; uniform routing over 256 would reach 8 x (1 - C(224, 8) / C(256, 8)) nodes
    (issue 57, correction 4). The spec states the bound."""
    from math import comb

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.planner.a2a_cost import node_share

    assert node_share(256, 8, 8, (8, 4)) == 0.5
    uniform = 8 * (1 - comb(224, 8) / comb(256, 8)) / 8
    assert node_share(256, 8, 8) == uniform and 0.66 < uniform < 0.67
    # groups spanning two nodes each: not modelled, uniform routing
    assert node_share(256, 8, 16, (8, 4)) == node_share(256, 8, 16)
    cfg = load_config(["--config", os.path.join(os.path.dirname(CONFIG), "deepseek_v3_671b.toml")])
    assert get_model_spec("deepseek_v3").routing_groups(cfg.model.args) == (8, 4)
    assert get_model_spec("qwen3_moe").routing_groups is None


def test_h800_links_are_deepseeks_and_each_figure_is_a_flag(capsys):
    """H800 as DeepSeek-V3's report states it: NVLink 160 GB/s usable, InfiniBand 50 GB/s
    (issue 57, correction 5); the memory bandwidth is a figure like the others."""
    from moetrain.planner.cli import main
    from moetrain.planner.hardware import PRESETS

    h800 = PRESETS["h800"]
    assert (h800.intra_gbps, h800.inter_gbps, h800.memory_gbps) == (160, 50, 3350)
    assert main(["--world-size=1", "--memory-gbps=0", "--config", CONFIG]) == 2
    assert capsys.readouterr().err.startswith("error: --memory-gbps '0': give GB/s")


def test_the_optimizer_step_streams_its_state_at_the_memory_bandwidth(capsys, tmp_path):
    """One rank, fp32 on CPU, Qwen3-MoE debug (N = 971,136 parameters in T tensors): AdamW
    reads the parameters, gradients and both moments and writes the parameters and moments:
    2 x 4N + 4N + 2 x (8N + 4T) bytes (a 4-byte step count per tensor); with
    train.optimizer_state_dtype=bf16 the moments take 2 bytes each (issue 57, corrections
    6 and item 2: the planner counts it)."""
    import torch

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.planner.cli import main

    cfg = load_config(["--config", CONFIG])
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).build(cfg.model.args)
    n, t = 971_136, len(list(model.parameters()))
    for dtype, moments in (("fp32", 8 * n), ("bf16", 4 * n)):
        out = tmp_path / f"{dtype}.json"
        flags = [f"--train.optimizer_state_dtype={dtype}", "--memory-gbps=1000", f"--json={out}"]
        assert main(["--world-size=1", "--config", CONFIG, *flags]) == 0
        plan = json.loads(out.read_text())
        assert plan["per_rank"][0]["optimizer"] == moments + 4 * t
        streamed = 2 * 4 * n + 4 * n + 2 * (moments + 4 * t)
        assert plan["per_step"]["optimizer_memory"] == streamed
        assert plan["estimate"]["optimizer_s"] == streamed / 1e12
    assert "optimizer step 0.000 s at 1000 GB/s" in capsys.readouterr().out


def test_the_search_weighs_the_v_schedules_with_selective_checkpointing(tmp_path):
    """ZBVZeroBubble and DualPipeV are ranked with `selective` (which recomputes inside
    either half of their split backward), never with `full` (refused by the config)."""
    from moetrain.planner.cli import main

    out = tmp_path / "plan.json"
    argv = ["--world-size=2", "--config", CONFIG, "--search", "--workers=0", f"--json={out}"]
    assert main(argv) == 0
    ranked = json.loads(out.read_text())["search"]
    v = {(r["pp_schedule"], r["activation_checkpoint"]) for r in ranked if r.get("pp", 1) > 1}
    assert {("ZBVZeroBubble", "selective"), ("DualPipeV", "selective")} <= v
    assert not {("ZBVZeroBubble", "full"), ("DualPipeV", "full")} & v


def test_stages_of_a_v_are_balanced_per_rank():
    """Eight equal blocks and a head worth four on a pp 2 V (ranks hold stages 0 and 3, 1
    and 2): balancing stages ([2, 2, 3, 1]) puts the head's rank at 7 of 12; per rank, 6 and 6 with
    [1, 3, 3, 1] (issue 57, correction 3). Never worse than per stage, on random costs."""
    import random

    from moetrain.parallelisms.dims import stage_rank
    from moetrain.parallelisms.pipeline_split import (
        StageCosts,
        balanced_split,
        rank_balanced_split,
        rank_loads,
    )  # fmt: skip

    v = [stage_rank(s, 2, "DualPipeV") for s in range(4)]
    assert v == [0, 1, 1, 0]
    costs = StageCosts([1.0] * 8, 0.0, 4.0)
    assert rank_loads(costs, balanced_split(costs, 4), v) == [7, 5]
    assert rank_balanced_split(costs, v) == [1, 3, 3, 1]
    rng = random.Random(0)
    for _ in range(100):
        pp, n = rng.choice([2, 3, 4]), rng.randint(8, 14)
        for schedule in ("DualPipeV", "Interleaved1F1B"):
            ranks = [stage_rank(s, pp, schedule) for s in range(2 * pp)]
            c = StageCosts([rng.uniform(1, 5) for _ in range(n)], 0.0, rng.uniform(0, 10))
            split = rank_balanced_split(c, ranks)
            assert sum(split) == n and min(split) >= 1
            plain = balanced_split(c, 2 * pp)
            assert max(rank_loads(c, split, ranks)) <= max(rank_loads(c, plain, ranks))
