"""`profile.steps`: torch.profiler traces with the trainer's named ranges, on every rank."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch
from torch import nn

from moetrain.config import load_config, resume_notes
from moetrain.loop.profiling import StepProfiler
from tests.distributed import finish, launch_train
from tests.parity import TINY
from tests.test_mixture import DEBUG, _refused


def _range_names(trace_path) -> set[str]:
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("ph") == "X"}


@pytest.mark.slow
def test_two_rank_cp_ep_run_writes_traces_with_the_named_ranges(tmp_path):
    out_dir = tmp_path / "run"
    argv = [*TINY, "--train.steps=3", "--parallel.cp=2", "--parallel.ep=2"]
    argv += ["--profile.steps=[2, 3]", "--profile.top=5"]
    proc = launch_train(argv, out_dir, nproc=2)
    log = finish(proc, out_dir, timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert "profile of steps 2-3" in log and "Self CPU time total" in log
    for rank in (0, 1):
        names = _range_names(out_dir / "profile" / "step-2-3" / f"rank-{rank}.json.gz")
        expected = {"step 2", "step 3", "data.wait", "optimizer.step", "ep.dispatch", "ep.combine"}
        expected |= {"ep.all_to_all.backward", "cp.ring.step0", "cp.ring.step1.backward"}
        expected |= {f"layers.{i}.{d}" for i in range(3) for d in ("forward", "backward")}
        assert expected <= names, expected - names
        assert "step 1" not in names  # outside the window


def test_hooks_exist_only_inside_the_window(tmp_path):
    blocks = [(f"layers.{i}", nn.Linear(4, 4)) for i in range(2)]
    said = []
    prof = StepProfiler([2, 2], str(tmp_path), 0, torch.device("cpu"), blocks, said.append, 3)

    def step(n: int) -> None:
        prof.before_step(n)
        x = torch.randn(2, 4, requires_grad=True)
        for _, block in blocks:
            x = block(x)
        x.sum().backward()
        prof.after_step(n)

    hooks = lambda: sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for _, b in blocks)  # noqa: E731
    step(1)
    assert hooks() == 0
    prof.before_step(2)
    assert hooks() == 4
    prof.after_step(2)
    assert (
        hooks() == 0 and said and (tmp_path / "profile" / "step-2-2" / "rank-0.json.gz").is_file()
    )
    step(3)  # after the window: nothing again, no second trace
    assert hooks() == 0 and len(said) == 1


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 100])
def test_the_refusal_of_a_bad_window_suggests_a_valid_one(steps, capsys, monkeypatch):
    err = _refused([DEBUG, f"--train.steps={steps}", "--profile.steps=[3, 1]"], capsys, monkeypatch)
    assert "profile.steps=[3, 1] must be [first, last]" in err
    example = re.search(r"e\.g\. (profile\.steps=\S+)", err).group(1)
    cfg = load_config([DEBUG, f"--train.steps={steps}", f"--{example}"])  # passes validation
    assert cfg.profile.steps and cfg.profile.steps[1] <= steps


def test_a_window_before_the_resumed_step_is_noted():
    cfg = load_config(["--train.steps=10", "--profile.steps=[2, 3]"])
    notes = resume_notes(cfg, resume_step=3)
    assert len(notes) == 1 and notes[0].startswith("profile.steps=[2, 3] lies before step 4")
    assert resume_notes(cfg, resume_step=2) == []  # step 3 is still profiled
    assert resume_notes(load_config([]), resume_step=5) == []
