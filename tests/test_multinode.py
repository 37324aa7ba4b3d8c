"""A multi-node launch on one machine: two torchrun agents (`--nnodes=2`, c10d rendezvous on
localhost) x 2 workers each, HSDP across the two "nodes" and expert parallelism inside each;
one worker killed after a checkpoint restarts the workers of both agents in place, which
resume and finish with one process's losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moetrain.checkpoint.markers import COMPLETE
from tests.distributed import ROOT, free_port, read_metrics, run_train

RUN = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--model.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=2",
    "--train.steps=4",
    "--train.warmup_steps=2",
    "--checkpoint.interval=2",
    "--metrics.log_interval=1",
]
# replicas across the agents (ranks 0-1 on one, 2-3 on the other), shards and ep inside
LAYOUT = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"]
TIMEOUT_S = 240


def _agent(node: int, endpoint: str, run_id: str, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
           "--max-restarts=1", "train.py", *RUN, *LAYOUT, f"--job.output_dir={out}"]  # fmt: skip
    log = open(f"{out}.agent{node}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _kill_all(agents: list[subprocess.Popen]) -> None:
    for proc in agents:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _workers(proc: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return sorted(int(pid) for pid in found.stdout.split())


@pytest.mark.slow
def test_two_agents_hsdp_across_ep_inside_restart_in_place_and_match_one_process(tmp_path):
    out = tmp_path / "two_nodes"
    endpoint, run_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]
    agents = [_agent(node, endpoint, run_id, out) for node in (0, 1)]
    logs = lambda: "\n".join(Path(f"{out}.agent{n}.log").read_text() for n in (0, 1))  # noqa: E731
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "checkpoints" / "step-2" / COMPLETE).exists():
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                pytest.fail(f"no checkpoint at step 2 before the kill:\n{logs()[-4000:]}")
            time.sleep(0.01)
        os.kill(_workers(agents[1])[0], signal.SIGKILL)  # a worker of the second "node"
        for proc in agents:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        _kill_all(agents)
    assert [a.returncode for a in agents] == [0, 0], logs()[-4000:]
    assert "resumed from" in logs()
    two_nodes = read_metrics(out)
    one = run_train(RUN, tmp_path / "one")
    # the metrics file holds steps 1-2 of the first round and 3-4 of the restarted one
    assert [r["step"] for r in two_nodes] == [1, 2, 3, 4]
    for ours, ref in zip(two_nodes, one, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
