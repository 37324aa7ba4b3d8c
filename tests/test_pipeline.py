"""Pipeline stages without a process group: the cut (FLOPs balance, hand-set counts), the
pruned stages' names, the schedules' micro-batch needs and the refusals. (The numerics of
every schedule against one process: the pp rows of tests/test_layout_parity.py.)"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from moetrain.config import ConfigError, load_config
from moetrain.models import get_model_spec
from moetrain.parallelisms.dims import (
    LayoutError,
    check_pipeline,
    pipeline_micro_batches_needed,
    stage_rank,
)
from moetrain.parallelisms.pipeline_build import cut_pipeline, stage_module
from moetrain.parallelisms.pipeline_split import (
    StageCosts,
    balanced_split,
    stage_costs,
    trunk_blocks,
)
from tests.parity import TINY, TINY_DSV3

L4 = "--model.num_hidden_layers=4"


def _brute_force(costs: StageCosts, stages: int) -> float:
    """The least possible costliest stage, over every contiguous split."""
    n, best = len(costs.blocks), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs.blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += costs.first
        loads[-1] += costs.last
        best = min(best, max(loads))
    return best


def test_balanced_split_is_optimal_and_covers_every_block():
    rng = random.Random(0)
    for _ in range(200):
        n, stages = rng.randint(2, 9), rng.randint(2, 4)
        if stages > n:
            continue
        costs = StageCosts(
            [rng.uniform(1, 10) for _ in range(n)], rng.uniform(0, 5), rng.uniform(0, 20)
        )
        counts = balanced_split(costs, stages)
        assert sum(counts) == n and len(counts) == stages and min(counts) >= 1
        bounds = list(itertools.accumulate([0, *counts]))
        loads = [sum(costs.blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += costs.first
        loads[-1] += costs.last
        assert max(loads) == pytest.approx(_brute_force(costs, stages))


def test_a_heavy_head_gets_fewer_blocks():
    # Equal blocks, a head worth two of them: the last stage takes two blocks fewer.
    assert balanced_split(StageCosts([1.0] * 8, 0.0, 2.0), 2) == [5, 3]
    assert balanced_split(StageCosts([1.0] * 8, 0.0, 0.0), 2) == [4, 4]


def _model(argv):
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
    attention = spec.flops_per_token(model, cfg.data.seq_len).by_kind["attention"]
    return cfg, spec, model, attention


def test_dsv3_costs_weigh_dense_moe_and_head_blocks_differently():
    _, spec, model, attention = _model(TINY_DSV3)
    costs = stage_costs(model, spec.plan, attention)
    # one dense block, then MoE blocks of equal cost; the MTP block is the head's
    assert [f for f, _ in trunk_blocks(model, spec.plan)] == ["layers.0", "layers.1", "layers.2"]
    assert costs.blocks[0] != costs.blocks[1] == costs.blocks[2]
    assert costs.last > costs.blocks[1]  # norm, head and the MTP block


@pytest.mark.parametrize(
    "argv, shared",
    [
        (TINY + ["--parallel.pp=2"], False),
        (TINY + ["--parallel.pp=2", "--model.tie_word_embeddings=true"], True),
        (TINY_DSV3 + ["--parallel.pp=2"], True),  # MTP embeds tokens
        # the first and last stage on one rank: two copies there
        (TINY_DSV3 + ["--parallel.pp=2", "--parallel.pp_schedule=DualPipeV", L4], True),
        (
            TINY
            + ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B"]
            + ["--model.num_hidden_layers=4"],
            False,
        ),
    ],
)
def test_stages_partition_the_model_under_its_own_names(argv, shared):
    cfg, spec, model, attention = _model(argv)
    cut = cut_pipeline(
        model, spec.plan, cfg.parallel, attention, spec.loss_terms(cfg.model.args).mtp_depth
    )
    assert cut.embedding_on_last == shared
    whole = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for index in range(cut.num_stages):
        stage = stage_module(model, spec.plan, cut, index)
        for name, param in stage.named_parameters():
            assert whole[name].shape == param.shape  # checkpoint keys do not depend on pp
            seen[name] = seen.get(name, 0) + 1
    assert seen.keys() == whole.keys()
    twice = {n for n, k in seen.items() if k == 2}
    assert twice == ({"embed_tokens.weight"} if shared else set())


def test_hand_set_cut_must_cover_the_blocks():
    cfg, spec, model, attention = _model(TINY + ["--parallel.pp=2", "--parallel.pp_layers=[1,1]"])
    with pytest.raises(
        LayoutError, match=r"pp_layers=\[1, 1\] must give 2 stages .* 3 blocks.*\[2, 1\]"
    ):
        cut_pipeline(model, spec.plan, cfg.parallel, attention, 0)
    cfg, spec, model, attention = _model(TINY + ["--parallel.pp=2", "--parallel.pp_layers=[1,2]"])
    assert cut_pipeline(model, spec.plan, cfg.parallel, attention, 0).blocks == [
        ["layers.0"],
        ["layers.1", "layers.2"],
    ]


def test_schedules_place_stages_and_need_micro_batches():
    assert [stage_rank(s, 2, "Interleaved1F1B") for s in range(4)] == [0, 1, 0, 1]
    assert [stage_rank(s, 2, "ZBVZeroBubble") for s in range(4)] == [0, 1, 1, 0]
    assert pipeline_micro_batches_needed("1F1B", 4, 4) is None
    assert pipeline_micro_batches_needed("1F1B", 4, 3) == "at least 4 micro-batches per step"
    assert pipeline_micro_batches_needed("DualPipeV", 2, 3) == "at least 4 micro-batches per step"
    assert (
        "(2 rounds for 5, which they do not divide): e.g. 4 or 6"
        in pipeline_micro_batches_needed("Interleaved1F1B", 2, 5)
    )
    with pytest.raises(LayoutError, match=r"needs at least 4 .* runs 2 .*global_batch_size=32"):
        check_pipeline(4, "1F1B", 1, 2, 16)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--parallel.pp_layers=[2,2]"], "parallel.pp_layers is set but parallel.pp=1"),
        (["--parallel.pp=2", "--parallel.pp_layers=[1,1,1]"], "has 3 entries, but parallel.pp=2"),
        (
            ["--parallel.pp=2", "--moe.aux_loss_layers=pooled"],
            "moe.aux_loss_layers=pooled does not",
        ),
        (["--parallel.pp=2", "--parallel.fsdp_gather=step"], "already does"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--train.compile=true"],
            "torch.compile does not support",
        ),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=DualPipeV"]
            + ["--train.activation_checkpoint=full"],
            "cannot replay its forward for both",
        ),
    ],
)
def test_pipeline_config_refusals(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY + extra)
