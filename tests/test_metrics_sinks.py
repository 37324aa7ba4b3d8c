"""What users watch: TensorBoard events that read back with the logged values, PNG plots
of a finished run, and clean refusals when an optional package or the metrics are missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moetrain import train
from moetrain.metrics.plot import main as plot
from tests.distributed import ROOT, run_train

RUN = [
    "--config=configs/debug_qwen3_moe.toml",
    "--train.steps=3",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=2",
    "--data.seq_len=64",
    "--data.max_tokens=40000",
    "--metrics.log_interval=1",
    "--metrics.expert_load_interval=2",
]


@pytest.fixture(scope="module")
def run_with_tensorboard(tmp_path_factory):
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("tb") / "run"
    return out, run_train(RUN + ["--metrics.tensorboard=true"], out)


@pytest.mark.slow
def test_tensorboard_events_hold_the_logged_values(run_with_tensorboard):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = run_with_tensorboard
    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s"):
        logged = [(s.step, s.value) for s in events.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records]
    layers = len(records[0]["expert_load"])
    assert {f"expert_load/layer{i}" for i in range(layers)} <= set(tags["histograms"])
    assert "expert_load/heatmap" in tags["images"]
    assert f"expert_load_max_over_mean/layer{layers - 1}" in tags["scalars"]
    assert f"expert_load_starved/layer{layers - 1}" in tags["scalars"]
    # The run's first step (the routing of the weights it began from) and every 2nd step.
    assert [r["step"] for r in records if "expert_load" in r] == [1, 2]
    for r in records[:2]:
        load = torch.tensor(r["expert_load"], dtype=torch.float64)  # [L, E]
        mean = load.mean(1)
        assert r["expert_load_max_over_mean"] == pytest.approx((load.max(1).values / mean).tolist())
        assert r["expert_load_starved"] == (load < 0.1 * mean[:, None]).sum(1).tolist()


@pytest.mark.slow
def test_plot_writes_pictures_of_a_finished_run(run_with_tensorboard, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, records = run_with_tensorboard
    assert plot([str(out), "--out", str(tmp_path / "png")]) == 0
    written = capsys.readouterr().out.split()
    names = {p.rsplit("/", 1)[-1] for p in written}
    layers = len(records[0]["expert_load"])
    assert {"loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "balance.png"} <= names
    assert {f"expert_load_layer{i}.png" for i in range(layers)} <= names
    for path in written:
        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, path


def test_plot_refuses_a_directory_without_metrics(tmp_path, capsys):
    assert plot([str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_refused_before_any_work(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main(RUN + ["--metrics.wandb=true"]) == 2
    err = capsys.readouterr().err
    assert "metrics.wandb=true needs the `wandb` package: pip install wandb" in err


def test_plot_draws_dpo_rewards_when_the_run_logged_them(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import json

    fields = {"loss": 0.69, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    rewards = {
        "rewards/chosen": 0.1,
        "rewards/rejected": -0.1,
        "rewards/margins": 0.2,
        "rewards/accuracy": 0.75,
    }
    for name, extra in (("sft", {}), ("dpo", rewards)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": s, **fields, **extra}) for s in (1, 2, 3)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        assert plot([str(tmp_path / name)]) == 0
        names = {p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()}
        assert ("rewards.png" in names) == (name == "dpo")
