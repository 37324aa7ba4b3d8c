"""In-place restarts: `torchrun --max-restarts=1`, one worker killed with SIGKILL after a
checkpoint; the agent restarts the workers, which resume from the last complete checkpoint
and finish with the uninterrupted run's losses. And the store each round rendezvouses
through (`moetrain.build.distributed.round_store`), against announcements a dead round left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.build.distributed import ROUND_STORE_KEY, round_store
from moetrain.checkpoint.markers import COMPLETE
from tests.distributed import finish, free_port, kill_launch, launch_train, read_metrics, run_train

# Tiny and short: a launch is mostly start-up, and the test launches four times.
RUN = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--model.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=2",
    "--train.steps=4",
    "--train.warmup_steps=2",
    "--checkpoint.interval=2",
    "--metrics.log_interval=1",
]
REPEATS = 3  # the round-store bug this guards failed 14 of 20 cycles: 3 catch it
# A healthy launch takes 15-60 s here (two at a time, on a shared 2-core machine); a hung
# round fails the test instead of hanging CI.
LAUNCH_TIMEOUT_S = 180


def _log_tail(out: Path) -> str:
    return Path(f"{out}.log").read_text()[-3000:]


def _workers(proc: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return sorted(int(pid) for pid in found.stdout.split())


def _wait_for(path: Path, proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_launch(proc)
            pytest.fail(f"no {path} before the kill:\n{_log_tail(out)}")
        time.sleep(0.005)


def _kill_one_worker_and_finish(i: int, out: Path) -> list[dict]:
    """One fresh torchrun with a restart to spare; a worker killed once step 2 is saved."""
    # NOTE: both forms a user would type (--standalone: c10d on a free port, random run id).
    rdzv = ["--standalone"] if i % 2 else ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
    proc = launch_train(RUN, out, nproc=2, extra=("--max-restarts=1", *rdzv))
    _wait_for(out / "checkpoints" / "step-2" / COMPLETE, proc, out)
    os.kill(_workers(proc)[i % 2], signal.SIGKILL)  # either rank: both must come back
    try:
        output = finish(proc, out, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"repeat {i}: the restarted round hung:\n{_log_tail(out)}")
    assert proc.returncode == 0, f"repeat {i}:\n{output[-3000:]}"
    assert "resumed from" in output, f"repeat {i}: no resume:\n{output[-3000:]}"
    ckpts = out / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-2", "step-4"], i  # no half-written leftover
    assert all((ckpts / name / COMPLETE).is_file() for name in os.listdir(ckpts))
    return read_metrics(out)


@pytest.mark.slow
def test_kill_one_worker_and_torchrun_restarts_it_in_place(tmp_path):
    # NOTE: two launches at a time. A launch is mostly start-up (torchrun's agent, and each
    # round's workers importing torch), partly on one core: two in flight keep both busy.
    with ThreadPoolExecutor(max_workers=2) as pool:
        reference = pool.submit(run_train, RUN, tmp_path / "reference", nproc=2)
        restarted = [
            pool.submit(_kill_one_worker_and_finish, i, tmp_path / f"restart{i}")
            for i in range(REPEATS)
        ]
        runs = [run.result() for run in restarted]
    reference = reference.result()
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    for i, ours in enumerate(runs):
        assert [r["step"] for r in ours] == [1, 2, 3, 4], i
        for mine, ref in zip(ours, reference, strict=True):  # resume is exact
            assert (mine["loss"], mine["grad_norm"]) == (ref["loss"], ref["grad_norm"]), i


@pytest.mark.parametrize("leftover", ["dead-server", "live-server-other-token"])
def test_a_new_round_never_joins_the_store_of_the_round_before(leftover, monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    if leftover == "dead-server":  # what a killed round leaves: its rank 0's store, gone
        agent.set(
            ROUND_STORE_KEY,
            json.dumps({"host": "127.0.0.1", "port": free_port(), "token": "dead-round"}),
        )
    else:  # a port reused by another store: it answers, but not with the announced token
        other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        other.set("token", "someone-else")
        agent.set(
            ROUND_STORE_KEY,
            json.dumps({"host": "127.0.0.1", "port": other.port, "token": "dead-round"}),
        )
    found: list[dist.Store] = []
    # Rank 1 comes first and meets the leftover; rank 0 announces its store later.
    peer = threading.Thread(target=lambda: found.append(round_store(1, 2, timedelta(seconds=30))))
    peer.start()
    time.sleep(0.5)
    ours = round_store(0, 2, timedelta(seconds=30))
    peer.join(timeout=30)
    assert found, "rank 1 never found rank 0's store"
    ours.set("hello", "from rank 0")
    assert found[0].get("hello") == b"from rank 0"
