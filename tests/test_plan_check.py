"""A parallel plan must describe its model on every layout (moetrain.parallelisms.plan.check_plan):
a pattern that matches nothing, or a seam left unnamed, is refused before any work, with
exit 2 and no traceback, from train.py and from the planner alike, at ep = 1 too."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from moetrain.config import load_config
from moetrain.models import get_model_spec, model_names
from moetrain.parallelisms.plan import PlanError, check_plan, match_modules
from tests.distributed import ROOT

QWEN3 = "--config=configs/debug_qwen3_moe.toml"
TYPO = "layers.*.mlp.expert"  # one letter short of layers.*.mlp.experts


def _meta(name: str, *overrides: str):
    cfg = load_config([f"--config=configs/debug_{name}.toml", *overrides])
    spec = get_model_spec(name)
    with torch.device("meta"):
        return spec.build(cfg.model.args), spec.plan


@pytest.mark.parametrize("name", model_names())
def test_every_model_plan_describes_its_debug_model(name):
    model, plan = _meta(name)
    check_plan(model, plan)


@pytest.mark.parametrize(
    "field, pattern, match",
    [
        (
            "routed_experts",
            TYPO,
            "routed_experts pattern 'layers.\\*.mlp.expert' matches no module",
        ),
        ("blocks", ("layers.*", "blokcs.*"), "blocks pattern 'blokcs.\\*' matches no module"),
        ("fp32_modules", ("layers.*.mlp.gaet",), "fp32_modules pattern"),
        ("shared_experts", "layers.*.mlp.shared", "shared_experts pattern"),
        # A pattern that matches, yet leaves the later MoE layers' experts unnamed.
        ("routed_experts", "layers.1.mlp.experts", "does not name \\['layers.2.mlp.experts'"),
        ("attention_core", "layers.0.self_attn.core", "attention_core does not name"),
    ],
)
def test_a_plan_that_misses_is_refused(field, pattern, match):
    model, plan = _meta("qwen3_moe")
    with pytest.raises(PlanError, match=match):
        check_plan(model, dataclasses.replace(plan, **{field: pattern}))


def test_optional_patterns_may_match_nothing():
    # A tied head (no lm_head module) and a model built without MoE layers: nothing to name.
    tied, plan = _meta("qwen3_moe", "--model.tie_word_embeddings=true")
    assert match_modules(tied, "lm_head", "head", required=False) == []
    check_plan(tied, plan)
    dense, plan = _meta("qwen3_moe", "--model.num_experts=0")
    assert match_modules(dense, plan.routed_experts, "routed_experts", required=False) == []
    check_plan(dense, plan)
    # DeepSeek-V3 without MTP modules: `mtp` is optional, so every `mtp.*...` under it too ...
    no_mtp, plan = _meta("deepseek_v3", "--model.num_nextn_predict_layers=0")
    check_plan(no_mtp, plan)
    # ... but with them, a pattern under it must match.
    with_mtp, plan = _meta("deepseek_v3")
    wrong = ("layers.*.mlp.gate", "mtp.*.blok.mlp.gate")
    with pytest.raises(PlanError, match="'mtp.\\*.blok.mlp.gate' matches no module"):
        check_plan(with_mtp, dataclasses.replace(plan, fp32_modules=wrong))


@pytest.fixture
def typo_plan(monkeypatch):
    """Qwen3-MoE with a routed_experts typo, as a user's new model would have it."""
    import moetrain.loop.preflight as setup

    spec = get_model_spec("qwen3_moe")
    bad = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, routed_experts=TYPO))
    monkeypatch.setattr(setup, "get_model_spec", lambda name: bad)


def test_train_py_refuses_a_typo_at_ep1_with_exit_2(typo_plan, monkeypatch, capsys):
    from moetrain import train

    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main([QWEN3, "--train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "routed_experts pattern 'layers.*.mlp.expert' matches no module" in err
    assert "Traceback" not in err


def test_the_planner_refuses_a_typo_at_ep1_with_exit_2(typo_plan, monkeypatch, capsys):
    from moetrain.planner.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["--world-size", "2", QWEN3]) == 2
    err = capsys.readouterr().err
    assert "routed_experts pattern 'layers.*.mlp.expert' matches no module" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "config, billions",
    [("mixtral_8x7b", 46.70), ("qwen2_57b_a14b", 57.41), ("glm4_5_air", 106.85)],
)
def test_the_planner_plans_the_published_sizes(config, billions, tmp_path):
    """The models added through the contract at their published size: the dry run plans
    16 ranks with ep 8, and its shards add up to the whole model (fp32 parameters)."""
    out = tmp_path / "plan.json"
    subprocess.run(
        [sys.executable, "-m", "moetrain.planner", "--world-size=16", "--config",
         f"configs/{config}.toml", "--parallel.ep=8", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    plan = json.loads(out.read_text())
    assert plan["layout"]["ep"] == 8 and plan["estimate"]["step_s"] > 0
    params = sum(rank["params"] for rank in plan["per_rank"]) / 4  # fp32 bytes -> count
    assert params / 1e9 == pytest.approx(billions, rel=0.01)


def test_experts_fewer_than_the_fsdp_ranks_are_split_evenly(tmp_path):
    """Mixtral's 8 experts over 16 fsdp ranks at ep 1: sharded on dim 1 (moetrain/parallelisms/fsdp.py),
    so every rank holds the same share of every expert. Sharded on dim 0, 8 ranks would hold
    a whole expert each and 8 an expert's worth of padding: twice the experts' memory in
    all, and the optimizer state on half the ranks."""
    out = tmp_path / "plan.json"
    subprocess.run(
        [sys.executable, "-m", "moetrain.planner", "--world-size=16", "--config",
         "configs/mixtral_8x7b.toml", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    ranks = json.loads(out.read_text())["per_rank"]
    assert len(ranks) == 16
    assert sum(r["params"] for r in ranks) / 4 / 1e9 == pytest.approx(46.70, rel=0.01)
    optimizer = [r["optimizer"] for r in ranks]
    assert max(optimizer) / min(optimizer) < 1.01


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("deepseek_v3", ["--model.n_shared_experts=0"]),
        ("glm4_moe", ["--model.n_shared_experts=0"]),
        # ... and with a tied head without a bias: no lm_head either
        ("ernie4_5_moe", ["--model.moe_num_shared_experts=0", "--model.use_bias=false"]),
    ],
)
def test_a_model_built_without_shared_experts_is_described(name, overrides):
    model, plan = _meta(name, *overrides)
    assert match_modules(model, plan.shared_experts, "shared_experts", required=False) == []
    check_plan(model, plan)


def test_fsdp_placement_asks_only_of_expert_stacks():
    """FSDP calls the placement for every parameter of a block (norms of 128, biases):
    with 3 ranks, only the [8, ...] expert stacks, whose rows 3 divides, go by rows."""
    from moetrain.parallelisms.fsdp import _experts_by_rows

    model, plan = _meta("qwen3_moe", "--model.moe_intermediate_size=48")
    by_3 = _experts_by_rows(model, plan, 3)
    by_rows = {n for n, p in model.named_parameters() if by_3(p) is not None}
    assert by_rows and all(".mlp.experts." in n for n in by_rows)
    by_2 = _experts_by_rows(model, plan, 2)
    assert all(by_2(p) is None for p in model.parameters())  # 2 divides 8
