"""What `train.activation_checkpoint = "selective"` computes again, measured by the
planner (`moetrain.planner.recompute_cost`) and added to its step's compute
(`moetrain.planner.step_cost.estimate`), on hand figures (issue 57)."""

from __future__ import annotations

import json

import pytest

from tests.test_dry_run import CONFIG
from tests.test_planner_figures import DSV3


def _plan(tmp_path, config: str, mode: str) -> dict:
    from moetrain.planner.cli import main

    out = tmp_path / f"{mode}.json"
    argv = ["--world-size=1", "--config", config, f"--train.activation_checkpoint={mode}"]
    assert main([*argv, f"--json={out}"]) == 0
    return json.loads(out.read_text())


def _down_projections(config: str) -> tuple[int, int, int]:
    """(MoE layers, FLOPs a token of one of them spends in its routed experts' down-projection:
    top-k x 2 x dim x hidden, and in its shared experts' gate and up projections: 2 x their
    weights, 0 without), from the model itself."""
    import torch

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.models.common.moe import MoE

    cfg = load_config(["--config", config])
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).build(cfg.model.args)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    top_k = cfg.model.args.num_experts_per_tok
    shared = layers[0].shared_experts
    gate_up = 0 if shared is None else shared.gate_proj.weight.numel() * 2
    return len(layers), top_k * 2 * layers[0].experts.down_proj[0].numel(), 2 * gate_up


def test_selective_counts_the_mla_up_projections_once_more(tmp_path):
    """DeepSeek-V3 debug: every MLA layer (4 trunk blocks and the MTP module's) runs its
    up-projections again in backward, 2 x (q_b_proj + kv_b_proj weights) FLOPs per token,
    and every MoE layer its routed experts' down-projection (grouped GEMM), and nothing
    else that is a GEMM; the step's compute grows by those FLOPs at the planner's rate."""
    import torch

    from moetrain.config import load_config
    from moetrain.models import get_model_spec

    cfg = load_config(["--config", DSV3])
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).build(cfg.model.args)
    mla = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    per_layer = 2 * (mla[0].q_b_proj.weight.numel() + mla[0].kv_b_proj.weight.numel())
    assert (len(mla), per_layer) == (5, 2 * (64 * 4 * 48 + 32 * 4 * (32 + 24)))
    moe_layers, down, shared = _down_projections(DSV3)
    assert shared == 2 * 2 * 128 * 64  # gate and up, 128 wide, one shared expert of 64
    none, sel = (_plan(tmp_path, DSV3, m) for m in ("none", "selective"))
    est = sel["estimate"]
    again = len(mla) * per_layer + moe_layers * (down + shared)
    assert est["recomputed_flops_per_token"] == again
    assert none["estimate"]["recomputed_flops_per_token"] == 0
    hw = sel["hardware"]
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    rate = hw["tflops"] * 1e12 * hw["efficiency"]
    assert est["recompute_s"] == pytest.approx(again * tokens / rate, rel=1e-12)
    assert est["compute_s"] - none["estimate"]["compute_s"] == pytest.approx(
        est["recompute_s"], rel=1e-9
    )
    assert est["flops_per_rank"] - none["estimate"]["flops_per_rank"] == pytest.approx(
        again * tokens, rel=1e-12
    )


def test_selective_by_block_structure_under_pipeline_stages():
    """The same figure per block, which pipeline stages are charged by: each MLA block
    structure (dense, MoE, MTP) recomputes 2 x (q_b_proj + kv_b_proj) per token, and a MoE
    one its experts' down-projection; Qwen3-MoE debug's MoE blocks that alone (its other
    regions, norms, SwiGLU, q/k norm and RoPE, hold no GEMM)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moetrain.config import load_config
    from moetrain.planner.layout_cost import measure_layout
    from moetrain.planner.recompute_cost import recomputed_by_structure, recomputed_per_token

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        ds = measure_layout(load_config(["--config", DSV3]), 1).activations
        qwen = measure_layout(load_config(["--config", CONFIG]), 1).activations
    finally:
        dist.destroy_process_group()
    per_layer = 2 * (64 * 4 * 48 + 32 * 4 * (32 + 24))
    ds_moe, ds_down, ds_shared = _down_projections(DSV3)
    qwen_moe, qwen_down, qwen_shared = _down_projections(CONFIG)
    assert qwen_shared == 0  # Qwen3-MoE has no shared expert
    moe_block = per_layer + ds_down + ds_shared
    assert set(recomputed_by_structure(ds).values()) == {per_layer, moe_block}
    assert recomputed_per_token(ds) == {
        "dense": 5 * per_layer + ds_moe * ds_shared,
        "grouped": ds_moe * ds_down,
    }
    assert recomputed_per_token(qwen) == {"grouped": qwen_moe * qwen_down}
    assert set(recomputed_by_structure(qwen).values()) == {0.0, qwen_down}


def test_qwen3_selective_adds_the_experts_down_projection_alone(tmp_path):
    moe_layers, down, _ = _down_projections(CONFIG)
    none, sel = (_plan(tmp_path, CONFIG, m) for m in ("none", "selective"))
    assert sel["estimate"]["recomputed_flops_per_token"] == moe_layers * down
    assert sel["estimate"]["compute_s"] > none["estimate"]["compute_s"]
