"""Launches: ours dispatches no more aten ops than torchtitan 0.2.2's Qwen3 MoE, counted on CPU
at the same tiny widths (8 experts, top-2, fp32, fused AdamW, one process, the same tokens)
by benchmarks/op_counts.py, both sides' experts looping (torchtitan's only CPU path)."""

from __future__ import annotations

import argparse

from benchmarks import op_counts  # torchtitan 0.2.2 is a dev dependency (pyproject.toml)


def test_ours_launches_no_more_ops_than_torchtitan():
    args = argparse.Namespace(layers=2, seq=64, rounds=1, gemm="loop")
    result = op_counts.measure(args, timed=False)
    step, layer = result["per_step"], result["per_moe_layer_fwd_bwd"]
    # A whole training step (ours: Trainer.advance as train.py runs it) and one MoE layer's
    # forward and backward.
    assert step["ours"]["aten_ops"] <= step["torchtitan"]["aten_ops"], step
    assert layer["ours"]["aten_ops"] <= layer["torchtitan"]["aten_ops"], layer
    # The layer without the experts' arithmetic: routing, statistics, permutation, combine.
    ours, theirs = (layer[s]["aten_ops_without_experts"] for s in ("ours", "torchtitan"))
    assert 0 < ours <= theirs, layer
