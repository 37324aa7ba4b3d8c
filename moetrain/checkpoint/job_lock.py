"""One live run per job directory: `job.output_dir/run.lock`, held while a run lives.

Two launches into one job directory would both save `step-N` there and resume from each
other's checkpoints. The run's rank 0 takes an exclusive `flock` on the lock file before any
process group exists (`train.py`), and the kernel releases it when the process ends, however
it ends (SIGKILL, a crash, a node lost): no stale lock is ever left to clean up by hand. The
holder writes who it is into the file, so that a second launch is refused naming the live
process. Torch-free, like everything `train.py` needs before it refuses.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time

from moetrain.errors import CheckpointError

LOCK_NAME = "run.lock"


def _holder(path: str) -> str:
    """Who holds the lock, as its holder wrote it ("" before it has)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


class JobLock:
    """The lock of one job directory, held from `acquire` until `release` or the process's end."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, output_dir: str) -> JobLock:
        """Take `output_dir`'s lock (making the directory), or raise CheckpointError naming
        the live process that holds it and the fix."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _holder(path) or "another process (it has not written its name yet)"
            raise CheckpointError(
                f"job.output_dir {output_dir} is in use by a live run: {holder}. Two runs "
                "in one job directory would save over and resume from each other's "
                "checkpoints; wait for that run to end or stop it, or give this run another "
                "--job.output_dir"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        command = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        if len(command) > 160:
            command = command[:157] + "..."
        me = f"pid {os.getpid()} on host {socket.gethostname()}, started {started} ({command})"
        os.ftruncate(fd, 0)
        os.pwrite(fd, (me + "\n").encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Let the next run in (the file stays: removing it would race with a new holder)."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
