"""What `train.activation_checkpoint = "selective"` computes again, measured by the
planner (`trainer.dry_run.recompute_cost`) and added to its step's compute
(`trainer.dry_run.step_cost.estimate`), on hand figures (issue 57)."""

from __future__ import annotations

import json

import pytest

from tests.test_dry_run import CONFIG
from tests.test_planner_figures import DSV3


def _plan(tmp_path, config: str, mode: str) -> dict:
    from trainer.dry_run.cli import main

    out = tmp_path / f"{mode}.json"
    argv = ["--world-size=1", "--config", config, f"--train.activation_checkpoint={mode}"]
    assert main([*argv, f"--json={out}"]) == 0
    return json.loads(out.read_text())


def test_selective_counts_the_mla_up_projections_once_more(tmp_path):
    """DeepSeek-V3 debug: every MLA layer (4 trunk blocks and the MTP module's) runs its
    up-projections again in backward, 2 x (q_b_proj + kv_b_proj weights) FLOPs per token,
    and nothing else that is a GEMM; the step's compute grows by those FLOPs at the
    planner's rate."""
    import torch

    from models import get_model_spec
    from trainer.config import load_config

    cfg = load_config(["--config", DSV3])
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).build(cfg.model.args)
    mla = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    per_layer = 2 * (mla[0].q_b_proj.weight.numel() + mla[0].kv_b_proj.weight.numel())
    assert (len(mla), per_layer) == (5, 2 * (64 * 4 * 48 + 32 * 4 * (32 + 24)))
    none, sel = (_plan(tmp_path, DSV3, m) for m in ("none", "selective"))
    est = sel["estimate"]
    assert est["recomputed_flops_per_token"] == len(mla) * per_layer
    assert none["estimate"]["recomputed_flops_per_token"] == 0
    hw = sel["hardware"]
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    rate = hw["tflops"] * 1e12 * hw["efficiency"]
    assert est["recompute_s"] == pytest.approx(len(mla) * per_layer * tokens / rate, rel=1e-12)
    assert est["compute_s"] - none["estimate"]["compute_s"] == pytest.approx(
        est["recompute_s"], rel=1e-9
    )
    assert est["flops_per_rank"] - none["estimate"]["flops_per_rank"] == pytest.approx(
        len(mla) * per_layer * tokens, rel=1e-12
    )


def test_selective_by_block_structure_under_pipeline_stages():
    """The same figure per block, which pipeline stages are charged by: each MLA block
    structure (dense, MoE, MTP) recomputes 2 x (q_b_proj + kv_b_proj) per token; Qwen3-MoE
    debug's regions (norms, SwiGLU, q/k norm and RoPE) hold no GEMM."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.config import load_config
    from trainer.dry_run.layout_cost import measure_layout
    from trainer.dry_run.recompute_cost import recomputed_by_structure, recomputed_per_token

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        ds = measure_layout(load_config(["--config", DSV3]), 1).activations
        qwen = measure_layout(load_config(["--config", CONFIG]), 1).activations
    finally:
        dist.destroy_process_group()
    per_layer = 2 * (64 * 4 * 48 + 32 * 4 * (32 + 24))
    assert set(recomputed_by_structure(ds).values()) == {per_layer}
    assert recomputed_per_token(ds) == {"dense": 5 * per_layer}
    assert recomputed_per_token(qwen) == {}
    assert set(recomputed_by_structure(qwen).values()) == {0.0}


def test_qwen3_selective_adds_no_compute(tmp_path):
    none, sel = (_plan(tmp_path, CONFIG, m) for m in ("none", "selective"))
    assert sel["estimate"]["recomputed_flops_per_token"] == 0
    assert sel["estimate"]["compute_s"] == none["estimate"]["compute_s"]
