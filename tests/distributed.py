"""Run a function on N real processes (gloo, CPU), as torchrun would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # 2-core machine: N ranks must not oversubscribe it
    fn(rank, world_size, *args)
    if dist.is_initialized():
        # NOTE: every rank passes its last collective before any rank tears gloo down; a
        # rank exiting while a peer still talks to it can abort (SIGABRT) at shutdown.
        dist.barrier()
        dist.destroy_process_group()
    # NOTE: skip interpreter teardown. Rarely (seen about once in 50 runs, only with
    # all-to-all traffic) a worker aborted in C++ static destruction after its work was
    # done and saved ("terminate called without an active exception"), failing the test
    # for a reason unrelated to what it checks. The results are on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) in `world_size` spawned processes; fn must be a
    module-level function, and may leave its process group for the harness to destroy.
    Raises if any rank fails."""
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )


ROOT = Path(__file__).resolve().parent.parent


def launch_train(
    args: list[str], out_dir: Path, nproc: int = 1, extra: tuple = ()
) -> subprocess.Popen:
    """Start `train.py` through the front door: plain python for 1 rank, torchrun for more.

    Its stdout and stderr go to `<out_dir>.log` (a file, not a pipe: a test that polls the
    run instead of reading its output must not block it); see `finish`.
    """
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out_dir}.log", "w") as log:
        return subprocess.Popen(
            [*launcher, "train.py", *args, f"--job.output_dir={out_dir}"],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so a test can signal the whole launch
        )


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and its workers (torchrun starts workers in sessions of their own)."""
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    for pid in [*map(int, found.stdout.split()), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def finish(proc: subprocess.Popen, out_dir: Path, timeout: float = 600) -> str:
    """Wait for a launched run (killing it if it overstays); returns its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)  # never leave a hung run behind on a shared machine
        raise
    return Path(f"{out_dir}.log").read_text()


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def run_train(args: list[str], out_dir: Path, nproc: int = 1) -> list[dict]:
    """Run train.py to completion (must succeed); returns its metrics.jsonl records."""
    proc = launch_train(args, out_dir, nproc)
    output = finish(proc, out_dir)
    assert proc.returncode == 0, output[-3000:]
    return read_metrics(out_dir)


def run_per_world(fn: Callable, worlds: tuple[int, ...], tmp_dir_factory, tag: str) -> dict:
    """fn(rank, world_size, out_path) on each world size (one spawn each) -> {world size:
    what it saved to out_path with torch.save}."""
    results = {}
    for world in worlds:
        path = tmp_dir_factory.mktemp(f"{tag}{world}") / "out.pt"
        run_distributed(fn, world, str(path))
        results[world] = torch.load(path)
    return results
