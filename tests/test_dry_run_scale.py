"""The planner's figures at scale, each against a count by hand (issue 66): the stage inputs
a pipeline rank keeps for its micro-batches in flight, the memory a GPU exposes less the
reserve for the CUDA context and NCCL buffers, and the routing imbalance's margin on the
busiest rank's saved expert rows."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moetrain.config import load_config
from tests.test_dry_run import CONFIG

# configs/debug_qwen3_moe.toml: fp32, micro-batch 4 x 128 tokens, hidden 128, 4 blocks (the
# first dense), 8 experts of width 64, top 2
B, S, H, TOP_K, EXPERTS, MOE_LAYERS, FP32 = 4, 128, 128, 2, 8, 3, 4


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _measured(*argv: str, imbalance: float = 1.0, reuse=None, world: int = 2):
    from moetrain.planner.layout_cost import measure_layout

    cfg = load_config(["--config", CONFIG, *argv])
    return measure_layout(cfg, world, ("selective",), reuse, imbalance)


def test_each_stage_keeps_its_input_for_every_micro_batch_in_flight(fake_world):
    """pp 2 (1F1B), 4 micro-batches: torch's stage keeps each received input until its
    backward, one [4, 128, 128] fp32 hidden state (256 KiB) a micro-batch; the first stage's
    is the embedding's output, which the whole-model trace left to the last stage. So the
    stages' saved bytes add up to the whole model's and one more input per boundary, and
    the first rank, holding pp = 2 micro-batches, holds 2 inputs."""
    layout = _measured("--parallel.pp=2")  # global batch 16 = 4 micro-batches of 4
    pc, trace = layout.pipeline, layout.activations["selective"]
    hidden = B * S * H * FP32
    assert pc.hidden_bytes == hidden == 262_144
    saved = pc.saved["selective"]
    assert sum(saved) == pytest.approx(trace.saved_after_forward + hidden)
    assert pc.in_flight == [2, 1]  # 1F1B: the first stage holds pp micro-batches
    transient = pc.transient["selective"]
    assert pc.activations["selective"] == [int(2 * saved[0]) + transient, int(saved[1]) + transient]
    blocks = [
        sum(trace.saved_by_structure[k] for k in stage) for stage in _stage_structures(layout)
    ]
    assert saved[0] == pytest.approx(blocks[0] + hidden)  # its blocks and its input


def _stage_structures(layout) -> list:
    """stage -> the block structures of its blocks, from the trainer's cut."""
    from moetrain.models import get_model_spec
    from moetrain.planner.pipeline_stages import _cut_of
    from moetrain.planner.shards import Measured

    cfg = layout.cfg
    return _cut_of(cfg, get_model_spec(cfg.model.name), Measured()).structures


def test_the_routing_imbalance_grows_the_busiest_ranks_saved_rows(fake_world):
    """ep 2, `selective`: a MoE layer keeps its experts' input (top-2 rows of 128 a token) and
    SwiGLU's input (gate and up, 2 x 64 a row), fp32, and its 8 experts' row counts (int64):
    3 layers x (4 x 128 x 2 x (128 + 128) x 4 + 8 x 8) bytes. 1.5 x the mean rows on the
    busiest rank adds half of them to its peak; without EP a rank takes every row, whatever
    the routing: nothing."""
    from moetrain.planner.layout_cost import Measured, peak_bytes, rows_margin

    rows = MOE_LAYERS * (B * S * TOP_K * (H + 2 * 64) * FP32 + EXPERTS * 8)
    reuse = Measured()  # the three share their trace
    even = _measured("--parallel.ep=2", reuse=reuse)
    assert even.activations["selective"].saved_rows == rows == 3_145_920
    skewed = _measured("--parallel.ep=2", imbalance=1.5, reuse=reuse)

    assert rows_margin(skewed, "selective") == rows // 2
    assert peak_bytes(skewed, "selective") - peak_bytes(even, "selective") == rows // 2
    no_ep = _measured(imbalance=1.5, reuse=reuse)
    assert no_ep.routing_imbalance == 1.0 and rows_margin(no_ep, "selective") == 0


def test_usable_memory_is_what_the_gpu_exposes_less_the_reserve(fake_world, capsys):
    """An "80 GB" H100 or H800 exposes 81,559 MiB (79.6 GiB), a "141 GB" H200 143,771 MiB;
    the planner keeps 2 GiB of it back for the CUDA context and NCCL's buffers. A budget a
    peak fits only without the reserve does not fit with it."""
    from moetrain.planner.cli import main
    from moetrain.planner.hardware import PRESETS, usable_gib
    from moetrain.planner.report import format_report, report

    assert round(PRESETS["h800"].memory_gib, 1) == 79.6 == round(PRESETS["h100"].memory_gib, 1)
    assert round(PRESETS["h200"].memory_gib, 1) == 140.4
    assert usable_gib(PRESETS["h800"]) == pytest.approx(81559 / 1024 - 2)
    assert usable_gib(PRESETS["h800"], 80.0) == 78.0 and PRESETS["h800"].reserve_gib == 2.0
    layout = _measured("--train.activation_checkpoint=selective")
    peak = report(layout, None, [])["peak"] / 2**30
    for reserve, fits in ((0.0, True), (1.0, False)):
        plan = report(layout, peak + 0.5, [], reserve)
        assert plan["usable_gib"] == pytest.approx(peak + 0.5 - reserve)
        assert plan["fits"] is fits
    assert "less 1 GiB kept back (--memory-reserve: CUDA context" in format_report(plan)
    dist.destroy_process_group()  # (the planner's main starts its own; refused before it)
    try:
        for flag, value in (("--memory-reserve", "-1"), ("--routing-imbalance", "0.9")):
            assert main(["--world-size=1", "--config", CONFIG, f"{flag}={value}"]) == 2
            assert capsys.readouterr().err.startswith(f"error: {flag} {value!r}: give ")
    finally:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


def test_causal_attention_is_counted_as_the_kernels_execute_it():
    """A causal kernel skips the 128 x 128 tiles above the diagonal and computes the diagonal
    ones whole: at 4096, 32 tiles a side, 33 / 64 of the product; one tile: all of it. The
    debug Qwen3-MoE at 4096 (4 layers, 4 heads of 32 for q/k and v): 6 x 4 x 4 x 64 x 4096
    attention FLOPs a token counted (MFU's), 33 / 64 of them executed."""
    from moetrain.planner.model_counts import causal_fraction, flops_per_token

    assert causal_fraction(4096) == 33 / 64 and causal_fraction(128) == 1.0
    assert causal_fraction(4097) == 34 / 66  # a partial last tile is a tile
    executed = flops_per_token(load_config(["--config", CONFIG, "--data.seq_len=4096"]))
    full = 6 * 4 * 4 * (32 + 32) * 4096
    assert executed.by_kind["attention"] == full * 33 / 64 == 12_976_128
    assert sum(executed.by_kind.values()) == pytest.approx(float(executed))


def test_fp8_runs_the_blocks_gemms_at_the_fp8_rate_and_pays_their_quantisation(fake_world):
    """The debug Qwen3-MoE by hand: FP8 takes every linear of the blocks but the routers (q
    and o 128 x 128, k and v 128 x 64 in 4 blocks; the dense block's MLP 3 x 128 x 256) and
    the routed experts (3 layers of 8 x (128 x 128 + 64 x 128), a token using 2 of 8); the
    head stays bf16. Each GEMM input is quantised twice (x and dy: forward and a gradient
    each; w: forward and input gradient, once per micro-batch) at 5 bytes an element (amax
    read, cast read, fp8 write). One rank, 2,048 tokens in 4 micro-batches, at 100 / 200
    TFLOP/s (bf16 / FP8) and 1 GB/s of memory: the step's compute loses the FP8 FLOPs' half
    and gains the quantisation's bytes."""
    from dataclasses import replace

    from moetrain.planner.hardware import PRESETS
    from moetrain.planner.layout_cost import measure_layout
    from moetrain.planner.model_counts import flops_per_token
    from moetrain.planner.step_cost import estimate

    assert {hw.fp8_tflops for hw in PRESETS.values()} == {1979}  # H100/H200/H800 SXM, dense
    assert all(hw.fp8_tflops == pytest.approx(2 * hw.tflops, rel=1e-3) for hw in PRESETS.values())
    dense = 4 * (2 * 128 * 128 + 2 * 128 * 64) + 3 * 128 * 256
    routed = 3 * 8 * (128 * 128 + 64 * 128)
    fp8_flops = 6 * (dense + routed * 2 / 8)
    x_dy = 4 * (2 * (128 + 128) + 2 * (128 + 64)) + 3 * (128 + 256)  # in + out, dense linears
    x_dy += 3 * 2 * ((128 + 128) + (64 + 128))  # routed: top-2 rows a token
    cfg = load_config(["--config", CONFIG])
    flops = flops_per_token(cfg)
    assert (flops.gemms.dense_weights, flops.gemms.routed_weights) == (dense, routed)
    assert flops.gemms.fp8_flops == fp8_flops == 2_654_208
    assert flops.gemms.quantise_bytes == 2 * 5 * x_dy == 74_240
    hw = replace(PRESETS["h100"], tflops=100, fp8_tflops=200, efficiency=1.0, memory_gbps=1.0)
    dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    layout = measure_layout(cfg, 1, ("none",))
    bf16 = estimate(layout, "none", flops, hw)
    layout.cfg.train.fp8 = "rowwise"
    fp8 = estimate(layout, "none", flops, hw)
    tokens, micro_batches = 16 * 128, 4
    quantise = x_dy * 2 * 5 * tokens + micro_batches * (dense + routed) * 2 * 5
    assert fp8["precision"]["quantise_bytes"] == quantise
    saved = fp8_flops * tokens * (1 / 100e12 - 1 / 200e12)
    assert fp8["compute_s"] == pytest.approx(bf16["compute_s"] - saved + quantise / 1e9)
    assert bf16["precision"] == {"fp8": "none"}
