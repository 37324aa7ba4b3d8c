"""Run a function, or train.py, on N real processes (gloo, CPU).

NOTE: ranks fork from a fork server that has already imported torch and the trainer (one
server per test session). A fresh Python process pays about 6 s of CPU for those imports
(torch, DTensor, flex attention's compiler stack); on a 2-core machine that was most of the
time of a short multi-rank test, and of the suite. A fork costs about 0.05 s. Each rank is
still a process of its own with its own gloo group, and a run calls `train.main` with the
environment torchrun gives its workers. The tests whose subject is torchrun itself (restarts,
signals, nodes, refusals, and one layout test) launch it: `launch_train`, or
`run_train(..., torchrun=True)`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent

# What the fork server imports before it forks a rank: everything heavy a rank needs.
_PRELOAD = (
    "torch",
    "torch.distributed.tensor",
    "moetrain.train",
    "moetrain.loop.preflight",
    "moetrain.build.model",
    "moetrain.loop.trainer",
    "tests.distributed",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork(fn: Callable, nprocs: int, args: tuple) -> mp.ProcessContext:
    """Start fn(i, *args) for i < nprocs on forks of the preloaded server."""
    mp.set_forkserver_preload(list(_PRELOAD))  # read once, when the server starts
    return mp.start_processes(fn, args, nprocs, join=False, start_method="forkserver")


def _enter(env: dict[str, str], cwd: str, log: str) -> None:
    """Give a forked rank the test's environment, directory and an output file.

    NOTE: a fork inherits the server's state, taken when the server started (maybe in an
    earlier test), not this test's: its environment, cwd and pytest's captured stdout.
    """
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)  # 2-core machine: N ranks must not oversubscribe it


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets that the trainer reads (one node)."""
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def _leave(code: int) -> None:
    # NOTE: skip interpreter teardown. Rarely (seen about once in 50 runs, only with
    # all-to-all traffic) a worker aborted in C++ static destruction after its work was
    # done and saved ("terminate called without an active exception"), failing the test
    # for a reason unrelated to what it checks. The results are on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, at: tuple) -> None:
    env, cwd, log = at
    _enter({**env, **_rank_env(rank, world_size, port)}, cwd, log)
    fn(rank, world_size, *args)
    if dist.is_initialized():
        # NOTE: every rank passes its last collective before any rank tears gloo down; a
        # rank exiting while a peer still talks to it can abort (SIGABRT) at shutdown.
        dist.barrier()
        dist.destroy_process_group()
    _leave(0)


def _join(ranks: mp.ProcessContext, timeout: float) -> BaseException | None:
    """Wait for every rank (killing all if one fails or they overstay); what went wrong."""
    try:
        for _ in range(int(timeout)):
            if ranks.join(timeout=1):
                return None
        raise TimeoutError(f"ranks still running after {timeout:.0f} s")
    except BaseException as err:  # noqa: BLE001 - handed to the caller, with the output
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
        return err


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) in `world_size` processes; fn must be a
    module-level function, and may leave its process group for the harness to destroy.
    Raises if any rank fails; what the ranks printed is printed here (pytest shows it)."""
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        at = (dict(os.environ, OMP_NUM_THREADS="1"), os.getcwd(), log.name)
        ranks = _fork(_entry, world_size, (fn, world_size, free_port(), args, at))
        failed = _join(ranks, timeout=3600)
        print(log.read(), end="")
    if failed is not None:
        raise failed


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


def _train_rank(rank: int, nproc: int, port: int, argv: list[str], at: tuple) -> None:
    """One rank of `train.py`, as torchrun's worker (or plain `python train.py` for one)."""
    env, cwd, log = at
    _enter({**env, **(_rank_env(rank, nproc, port) if nproc > 1 else {})}, cwd, log)
    from moetrain import train

    sys.argv = ["train.py", *argv]
    try:
        code = train.main(argv)
    except BaseException:  # noqa: BLE001 - as an uncaught error would: printed, exit 1
        traceback.print_exc()
        code = 1
    _leave(code)


def run_train(
    args: list[str], out_dir: Path, nproc: int = 1, torchrun: bool = False, timeout: float = 600
) -> list[dict]:
    """Run train.py to completion (must succeed); returns its metrics.jsonl records.

    The ranks fork from the preloaded server (see the module's note); `torchrun=True`
    launches torchrun instead, as `launch_train` does. Output goes to `<out_dir>.log`.
    """
    if torchrun:
        proc = launch_train(args, out_dir, nproc)
        output = finish(proc, out_dir, timeout)
        assert proc.returncode == 0, output[-3000:]
        return read_metrics(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log = Path(f"{out_dir}.log")
    log.write_text("")
    argv = [*args, f"--job.output_dir={out_dir}"]
    at = (dict(os.environ, OMP_NUM_THREADS="1"), str(ROOT), str(log))
    failed = _join(_fork(_train_rank, nproc, (nproc, free_port(), argv, at)), timeout)
    assert failed is None, f"{failed}\n{log.read_text()[-3000:]}"
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
