"""Pipeline stages through `train.py` against one process: the held-out loss under every
schedule (forward only, moetrain/parallelisms/pipeline_forward.py) and from `python -m
moetrain.evaluate` at pp 2, the logged expert load (counted once, not once per stage), and a
stage that trains no parameter (LoRA on the experts, its blocks dense), across a resume."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed, run_train
from tests.parity import TINY

EVAL = ["--eval.fraction=0.4", "--eval.samples=5", "--eval.micro_batch_size=2", "--eval.interval=1"]
# LoRA on the routed experts alone, blocks 0-1 dense: 1F1B's stage 0 (embedding + blocks
# 0-1) holds no trainable parameter. A constant lr: a run of 2 steps resumed to 3 takes the
# updates of one run of 3.
LORA = [
    *TINY,
    "--model.num_hidden_layers=4",
    "--model.mlp_only_layers=[0,1]",
    "--peft.method=lora",
    "--peft.targets=experts",
    "--train.schedule=constant",
    "--metrics.jsonl=true",
    "--metrics.log_interval=1",
    *EVAL,
]


def _evaluate_worker(rank: int, world: int, argv: list[str]) -> None:
    from moetrain.evaluate.cli import main

    assert main(argv) == 0


@pytest.mark.slow
def test_pipeline_runs_evaluate_log_and_train_as_one_process(tmp_path):
    reference = run_train([*LORA, "--train.steps=3"], tmp_path / "one")
    assert reference[0]["expert_load"]  # logged at the first step

    def same(ours: list[dict], keys: tuple[str, ...], steps: range) -> None:
        ref = {r["step"]: r for r in reference}
        for r in ours:
            if r["step"] in steps:
                for key in keys:
                    assert r[key] == pytest.approx(ref[r["step"]][key], rel=1e-5), (r["step"], key)
        assert {r["step"] for r in ours} >= set(steps)

    pp2 = ["--parallel.pp=2", "--checkpoint.interval=2"]
    # 1F1B: rank 0 trains nothing (no optimizer), yet clips, saves and resumes exactly.
    out = tmp_path / "1f1b"
    first = run_train([*LORA, *pp2, "--train.steps=2"], out, nproc=2)
    resumed = run_train([*LORA, *pp2, "--train.steps=3"], out, nproc=2)
    same(first + resumed, ("loss", "grad_norm", "eval_loss"), range(1, 4))
    # The expert load of the whole model, once: the one process's.
    assert first[0]["expert_load"] == reference[0]["expert_load"]
    # The V schedules: the held-out loss forward only, as one process's.
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        out = tmp_path / schedule
        records = run_train(
            [*LORA, *pp2, "--train.steps=2", f"--parallel.pp_schedule={schedule}"], out, nproc=2
        )
        same(records, ("loss", "grad_norm", "eval_loss"), range(1, 3))
        assert records[0]["expert_load"] == reference[0]["expert_load"]
    # python -m moetrain.evaluate at pp 2 (its check of the training batch does not refuse
    # it) gives the loss the DualPipeV run logged at step 2.
    logged = records[-1]["eval_loss"]
    result = tmp_path / "eval.json"
    argv = [*LORA, *pp2, "--parallel.pp_schedule=DualPipeV", "--checkpoint", str(out)]
    run_distributed(_evaluate_worker, 2, [*argv, "--json", str(result)])
    assert json.loads(result.read_text())["eval_loss"] == pytest.approx(logged, rel=1e-6)
