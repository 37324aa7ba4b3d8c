"""`RunState` (moetrain/checkpoint/run_state.py) is what `trainer_state.pt` holds besides the
weights' bookkeeping: its keys are the checkpoint format, and a state saved and loaded the
way checkpoints are (`torch.save`, `torch.load(weights_only=True)`) comes back whole.
tests/test_checkpoint.py resumes real runs through the front door."""

from __future__ import annotations

import torch

from moetrain.checkpoint.run_state import RunState
from moetrain.config import load_config
from moetrain.data.packing import CorpusSummary
from moetrain.data.sampler import GlobalBatchSampler, SampleOrder
from moetrain.loop.guard import StepGuard

# The keys of `trainer_state.pt` before the trainer was composed of parts (checkpoints
# written then must keep resuming); the checkpointer adds `frozen_saved`.
FORMAT = ["step", "guard", "data", "rng", "config", "data_identity", "base", "tokenizer"]
# Added since, each read with `.get` (a checkpoint without it resumes as before).
ADDED = ["dpo_reference"]


class _Dataset:
    """What the state records of the data: its summary (moetrain.checkpoint.resume.data_identity)."""

    summary = CorpusSummary("stdlib", 10, 4096, None, False, fingerprint="f" * 16)


def _state() -> RunState:
    cfg = load_config(["--config=configs/debug_qwen3_moe.toml"])
    t = cfg.train
    guard = StepGuard(t.max_skipped_steps, t.skip_spike_sigma, t.skip_spike_window)
    sampler = GlobalBatchSampler(64, 8, 2, 0, 1, seed=0)
    return RunState(cfg, SampleOrder(_Dataset(), sampler), guard, torch.device("cpu"), rank=0)


def test_a_saved_run_state_loads_back_whole(tmp_path):
    state = _state()
    for step, (loss, skipped) in enumerate([(3.0, False), (float("nan"), True), (2.5, False)]):
        state.guard.observe(loss, 1.0, skipped)
        state.step, state.consumed_samples = step + 1, 8 * (step + 1)
    state.base = {"source": "seed", "seed": 0}
    torch.manual_seed(7)
    saved = state.state_dict()
    assert list(saved) == FORMAT + ADDED
    torch.save(saved, tmp_path / "trainer_state.pt")

    torch.manual_seed(0)  # the fresh run's RNG, which the load replaces
    fresh = _state()
    fresh.load_state_dict(torch.load(tmp_path / "trainer_state.pt", weights_only=True))
    assert (fresh.step, fresh.consumed_samples) == (3, 24)
    assert fresh.guard.skipped_total == 1 and fresh.guard.state_dict() == saved["guard"]
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])
    again = fresh.state_dict()
    for key in ("step", "guard", "data", "config", "data_identity"):
        assert again[key] == saved[key], key
