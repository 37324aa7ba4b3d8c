"""The planner knows `train.objective=dpo` (issue 67, item 6; moetrain/planner/objective_cost.py):
each `dpo.reference` against counts by hand on the debug Qwen3-MoE (2 ranks, ep 2, fp32,
micro-batch 4 x 128, global batch 16: 2 micro-batches a rank per step): base adds one
forward's FLOPs, an all-to-all pair and an all-gather per micro-batch, and the step's
[4, 128] float64 per-document log-probability sums; copy adds the same and the parameters'
bytes; stored adds no step work, a one-off pass over the corpus and its table."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from moetrain.config import load_config
from moetrain.planner.hardware import hardware
from moetrain.planner.layout_cost import measure_layout, peak_bytes, step_bytes, update_bytes
from moetrain.planner.model_counts import flops_per_token
from moetrain.planner.report import estimate_notes, format_report, report
from moetrain.planner.step_cost import estimate
from tests.chat_model import save_chat_model
from tests.test_dry_run import CONFIG
from tests.test_preference_prepare import preference_pairs, prepare_pairs

B, S, MICRO_BATCHES, WORLD = 4, 128, 2, 2
LOGPS = MICRO_BATCHES * B * S * 8  # the step's reference sums, a float64 per document slot
TOKENS = 16 * S  # a step's tokens, all ranks
DATA = ["--data.source=tokens", "--data.path=pairs", "--data.document_mask=true"]
LAYOUT = ["--config", CONFIG, "--parallel.ep=2", *DATA]
DPO = ["--train.objective=dpo"]
H100 = hardware("h100")


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _plan(cfg):
    """(layout, its estimate) with no checkpointing: nothing recomputed."""
    cfg.train.activation_checkpoint = "none"
    layout = measure_layout(cfg, WORLD, ("none",))
    return layout, estimate(layout, "none", flops_per_token(cfg), H100)


def _resharded_gathers(layout) -> int:
    """Bytes one gather of the units resharded after a forward moves, counted from the
    SFT layout's two figures: per micro-batch each such unit is gathered twice (forward and
    backward) and the root once, per step (fsdp_gather=step) every unit once."""
    per_micro_batch = layout.comm["fsdp_all_gather"] // MICRO_BATCHES
    return per_micro_batch - layout.comm["fsdp_all_gather_once"]


def _dpo(*argv: str, reference: str, peft: str):
    return load_config(
        [*LAYOUT, *DPO, f"--peft.method={peft}", f"--dpo.reference={reference}", *argv]
    )


def test_a_base_reference_adds_one_forward_and_the_held_log_probabilities(fake_world):
    lora = ["--peft.method=lora"]
    sft, sft_est = _plan(load_config([*LAYOUT, *lora]))
    dpo, dpo_est = _plan(load_config([*LAYOUT, *lora, *DPO]))
    assert dpo.reference.source == "base"  # auto under LoRA
    forward = float(flops_per_token(dpo.cfg)) / 3 * TOKENS / WORLD
    assert dpo_est["flops_per_rank"] == pytest.approx(sft_est["flops_per_rank"] + forward)
    assert dpo_est["reference_flops_per_rank"] == pytest.approx(forward)
    assert dpo_est["compute_s"] == pytest.approx(sft_est["compute_s"] * 4 / 3)
    # One more all-to-all pair (dispatch and combine) per micro-batch: 3 where SFT has 2.
    assert dpo.comm["ep_all_to_all"] == pytest.approx(sft.comm["ep_all_to_all"] * 3 / 2, abs=2)
    # The units resharded after a forward gathered once more a micro-batch; the root (kept
    # gathered) and every unit under fsdp_gather=step serve the reference and the step alike.
    again = _resharded_gathers(sft) * MICRO_BATCHES
    assert 0 < again < MICRO_BATCHES * sft.comm["fsdp_all_gather_once"]
    assert dpo.comm["fsdp_all_gather"] == sft.comm["fsdp_all_gather"] + again
    assert dpo.comm["fsdp_all_gather_once"] == sft.comm["fsdp_all_gather_once"]
    # Memory: the step's log-probabilities, in the forwards' phase (the higher one here).
    assert step_bytes(sft, "none") > update_bytes(sft)
    assert peak_bytes(dpo, "none") - peak_bytes(sft, "none") == LOGPS == 8_192
    printed = format_report(report(dpo, None, []))
    assert "dpo.reference=base" in printed and "2 x [4, 128] float64 = 0.0078 MiB" in printed
    notes = estimate_notes(dpo_est, dpo.cfg, flops_per_token(dpo.cfg))
    assert any(f"{forward / 1e9:,.1f} GFLOP per rank" in n for n in notes)
    assert not any("dpo" in n for n in estimate_notes(sft_est, sft.cfg, flops_per_token(sft.cfg)))
    assert "objective" not in report(sft, None, [])


def test_a_copy_reference_rests_beside_the_policy_as_its_parameters(fake_world):
    sft, sft_est = _plan(load_config(LAYOUT))  # full fine-tuning
    copy, copy_est = _plan(_dpo(reference="copy", peft="none"))
    assert copy.state.params == sft.state.params and copy.state.frozen == [0, 0]
    assert copy.reference.resting == sft.state.params  # the parameters' bytes, each rank
    extra = sft.state.params[0] + LOGPS
    assert peak_bytes(copy, "none") - peak_bytes(sft, "none") == extra
    forward = float(flops_per_token(sft.cfg)) / 3 * TOKENS / WORLD
    assert copy_est["flops_per_rank"] == pytest.approx(sft_est["flops_per_rank"] + forward)
    assert copy.state.grads == sft.state.grads and copy.state.optimizer == sft.state.optimizer
    # The copy's own units: its root gathered once a step, its others once a micro-batch;
    # under fsdp_gather=step every one of them once.
    once = sft.comm["fsdp_all_gather_once"]
    again = _resharded_gathers(sft) * MICRO_BATCHES + (once - _resharded_gathers(sft))
    assert copy.comm["fsdp_all_gather"] == sft.comm["fsdp_all_gather"] + again
    assert copy.comm["fsdp_all_gather_once"] == 2 * once
    printed = format_report(report(copy, None, []))
    assert f"rests beside the policy: {sft.state.params[0] / 2**20:.2f} MiB on rank 0" in printed


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A prepared preference corpus (40 pairs) and the model its tokenizer belongs to."""
    root = tmp_path_factory.mktemp("planned_pairs")
    save_chat_model(root / "model")
    prepare_pairs(preference_pairs(40), root / "model", root / "pairs")
    return root


def test_a_stored_reference_costs_a_one_off_pass_and_its_table(fake_world, pairs):
    from moetrain.data.prepared import PreparedCorpus

    corpus = PreparedCorpus.open(str(pairs / "pairs")).manifest
    tokens, count = corpus.num_tokens, corpus.num_documents // 2
    assert count == 40
    path = f"--data.path={pairs / 'pairs'}"
    sft, sft_est = _plan(load_config([*LAYOUT, path]))
    stored, stored_est = _plan(_dpo(path, reference="stored", peft="none"))
    # No reference forward per step: the step's FLOPs and bytes moved are SFT's.
    assert stored_est["flops_per_rank"] == sft_est["flops_per_rank"]
    assert stored.comm == sft.comm
    # The table: two float64 sums a pair, on every rank.
    assert stored.reference.resting == [40 * 2 * 8] * WORLD
    assert peak_bytes(stored, "none") - peak_bytes(sft, "none") == 640
    # The one-off pass: one forward (a third of the training FLOPs) over the corpus' tokens,
    # split over the ranks, at the preset's peak and efficiency.
    rate = H100.tflops * 1e12 * H100.efficiency
    by_hand = float(flops_per_token(sft.cfg)) / 3 * tokens / WORLD / rate
    assert stored_est["first_pass_tokens"] == tokens
    assert stored_est["first_pass_s"] == pytest.approx(by_hand)
    notes = "\n".join(estimate_notes(stored_est, stored.cfg, flops_per_token(sft.cfg)))
    assert f"one forward over the corpus' {tokens:,} tokens" in notes
    assert "40 pairs x 2 float64 sums" in format_report(report(stored, None, []))


def test_the_planner_command_prints_what_dpo_adds(pairs, capsys, tmp_path):
    """`python -m moetrain.planner` on a DPO launch as docs/finetuning.md gives it (LoRA on
    a Hugging Face model, prepared pairs): every refusal of a launch applied, then the
    reference's lines and figures."""
    from moetrain.planner.cli import main

    out = tmp_path / "plan.json"
    argv = [
        "--world-size=2",
        "--config=configs/finetune_chat.toml",
        f"--model.init_from_hf={pairs / 'model'}",
        f"--data.tokenizer={pairs / 'model'}",
        f"--data.path={pairs / 'pairs'}",
        "--data.seq_len=256",
        "--train.global_batch_size=4",
        "--train.objective=dpo",
        "--peft.method=lora",
        f"--json={out}",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["objective"]["reference"] == "base"
    assert plan["objective"]["held_bytes"] == 2 * 1 * 256 * 8  # 2 micro-batches of [1, 256] sums
    assert plan["estimate"]["reference"] == "base"
    assert "dpo.reference=base: the step includes one forward of the frozen base" in printed
    assert "each micro-batch's reference log-probabilities" in printed


def test_under_pipeline_stages_the_reference_runs_forward_only_before_the_schedule(fake_world):
    """dpo.reference=base with 2 pipeline stages (1F1B, a stage a rank): the schedule's span
    is SFT's (the reference's forwards are not in its actions), and the reference's pass
    before it is n micro-batches through the busier stage's forward plus the fill, one
    forward of it (pp - 1 = 1): (n + 1) x its forward, a third of its compute per
    micro-batch."""
    pp = ["--parallel.pp=2", "--model.num_hidden_layers=4", "--peft.method=lora", *DATA]
    pp += ["--train.micro_batch_size=1"]
    layout = ["--config", CONFIG, *pp]
    sft, sft_est = _plan(load_config(layout))
    dpo, dpo_est = _plan(load_config([*layout, *DPO]))
    n = sft.pipeline.micro_batches
    assert sft_est["reference_pass_s"] == 0
    assert dpo_est["pipeline_span_s"] == pytest.approx(sft_est["pipeline_span_s"])
    forward = sft_est["compute_s"] / 3 / n  # the busier stage's forward of one micro-batch
    assert dpo_est["reference_pass_s"] == pytest.approx((n + 1) * forward)
    # (one stage group, no FSDP: nothing else moves)
    assert dpo_est["step_s"] - sft_est["step_s"] == pytest.approx(dpo_est["reference_pass_s"])
    # the step's sums held by the last stage (rank 1), the micro-batches' [1, 128] float64
    assert dpo.reference.held == n * 1 * 128 * 8
    assert peak_bytes(dpo, "none", 1) - peak_bytes(sft, "none", 1) == dpo.reference.held
    assert peak_bytes(dpo, "none", 0) == peak_bytes(sft, "none", 0)
    notes = estimate_notes(dpo_est, dpo.cfg, flops_per_token(dpo.cfg))
    assert any("a forward-only pass before the schedule" in n for n in notes)
