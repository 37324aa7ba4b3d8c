"""`benchmarks/gpu_suite.sh fp8` on CPU: the part the next lent GPU runs on the proxy (FP8
against bf16, eager and compiled), here one tiny rowwise run in fp32, eager: the same
script, run, summary and report (benchmarks/fp8_speed.py, whose comparison with bf16 is
checked on summaries of the suite's form)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from fp8_speed import compare  # noqa: E402  (a script of benchmarks/)

TINY_ARGS = (
    "--model.num_hidden_layers=2 --data.seq_len=64 --train.global_batch_size=2 "
    "--train.micro_batch_size=2 --data.max_tokens=100000 --train.warmup_steps=1"
)


@pytest.mark.slow
def test_the_gpu_suites_fp8_part_runs_on_cpu(tmp_path):
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        PY=sys.executable,
        DEVICE="cpu",
        PREC="fp32",
        PROXY_STEPS="2",
        FP8_MODES="eager",
        FP8_RECIPES="rowwise",
        FP8_CONFIG="configs/debug_qwen3_moe.toml",
        FP8_ARGS=TINY_ARGS,
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "fp8"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("fp8_rowwise_eager", "fp8_compare"):
        assert results["steps"][name]["rc"] == 0, (name, (tmp_path / "log.txt").read_text()[-3000:])
    assert results["train"]["fp8_rowwise_eager"]["steps"] == 2
    rowwise = results["bench"]["fp8_speed"]["comparison"]["eager"]["rowwise"]
    assert rowwise["median_step_s"] > 0 and "speedup_vs_bf16" not in rowwise  # no bf16 run
    assert "train.fp8=rowwise" in (tmp_path / "log.txt").read_text()  # the start-up note


def test_the_comparison_puts_each_recipe_beside_bf16_in_its_mode():
    summary = {
        "median_step_s": 2.0,
        "median_tokens_per_s": 10.0,
        "peak_mem_gib": 1.0,
        "loss_first": 5.0,
        "loss_last": 3.0,
    }
    runs = {
        "fp8_none_eager": summary,
        "fp8_rowwise_eager": {**summary, "median_step_s": 1.6, "loss_last": 3.03},
        "fp8_none_compile": summary,
        "fp8_tensorwise_compile": {"error": "KeyError: 'loss'"},
    }
    out = compare(runs, [*runs, "fp8_rowwise_compile"])
    assert out["eager"]["rowwise"]["speedup_vs_bf16"] == pytest.approx(1.25)
    assert out["eager"]["rowwise"]["loss_last_rel_vs_bf16"] == pytest.approx(0.01)
    assert "speedup_vs_bf16" not in out["eager"]["none"]
    assert out["compile"]["tensorwise"] == {"error": "KeyError: 'loss'"}
    assert out["compile"]["rowwise"] == {"error": "no run"}
