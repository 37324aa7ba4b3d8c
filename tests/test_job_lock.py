"""One live run per job directory (issue 64, item 12): `moetrain.checkpoint.job_lock`.

The refusal of a real second launch beside a live torchrun run is checked in
tests/test_checkpoint.py (the SIGTERM test's run); here, the lock's own life: held by a live
process, named in the refusal, and gone with the process however it ends."""

import os
import signal
import subprocess
import sys
import time

import pytest

from moetrain.checkpoint.job_lock import JobLock
from moetrain.errors import CheckpointError
from tests.distributed import ROOT

HOLD = "from moetrain.checkpoint.job_lock import JobLock; import sys, time; "
HOLD += "JobLock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def _holder(directory) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_a_killed_one_leaves_no_stale_lock(tmp_path):
    job = tmp_path / "job"
    proc = _holder(job)
    try:
        with pytest.raises(CheckpointError) as refused:
            JobLock.acquire(str(job))
        message = str(refused.value)
        assert message.startswith(f"job.output_dir {job} is in use by a live run: pid {proc.pid} ")
        assert "wait for that run to end or stop it, or give this run another" in message
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no chance to release: the kernel does
        proc.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            lock = JobLock.acquire(str(job))
            break
        except CheckpointError:
            assert time.monotonic() < deadline, "the lock outlived its holder"
            time.sleep(0.05)
    assert f"pid {os.getpid()} " in (job / "run.lock").read_text()
    with pytest.raises(CheckpointError):  # held by this process now: a second taker waits
        JobLock.acquire(str(job))
    lock.release()
    JobLock.acquire(str(job)).release()  # released: the next run goes in
