"""Run a function on N real processes (gloo, CPU), as torchrun would."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

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
