"""The planner's figures on hand-computed values: the model's parameter counts (issue 55),
and the step-time model's corrections of issue 57 (the MTP head's FLOPs, the per-rank
split of V stages, the node share of a group-limited router, named link rates, the
optimizer step's time, the interleaved refusal, the V schedules in the search)."""

from __future__ import annotations

import json

from tests.test_dry_run import CONFIG


def test_the_planner_prints_total_and_active_parameters(capsys, tmp_path):
    """Qwen3-MoE debug (configs/debug_qwen3_moe.toml), counted by hand from its config:
    hidden 128, vocab 320 (embedding and head apart), 4 blocks (block 0 dense), 4 heads of
    32, 2 KV heads, 8 experts of 64, top 2."""
    from trainer.dry_run.cli import main

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
