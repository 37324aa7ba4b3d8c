"""`benchmarks/gpu_suite.sh fp8` on CPU: the part the next lent GPU runs on the proxy (FP8
against bf16, eager and compiled), here on a tiny model in fp32, eager: the same script,
runs, summaries and comparison (benchmarks/fp8_speed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

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
        PROXY_STEPS="3",
        FP8_MODES="eager",
        FP8_RECIPES="none,rowwise",
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
    for name in ("fp8_none_eager", "fp8_rowwise_eager", "fp8_compare"):
        assert results["steps"][name]["rc"] == 0, (name, (tmp_path / "log.txt").read_text()[-3000:])
    assert results["train"]["fp8_rowwise_eager"]["steps"] == 3
    rowwise = results["bench"]["fp8_speed"]["comparison"]["eager"]["rowwise"]
    assert rowwise["speedup_vs_bf16"] > 0 and rowwise["loss_last_rel_vs_bf16"] < 2.0**-4
    assert "train.fp8=rowwise" in (tmp_path / "log.txt").read_text()  # the start-up note
    assert "FP8 step time against bf16: eager rowwise" in results["bench"]["fp8_speed"]["summary"]
