"""The training device and the process group: NCCL on CUDA, gloo on CPU, and a world of
one for a plain `python train.py`, so that every run takes the same code path."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetrain.parallelisms.dims import LayoutError, ParallelDims
from moetrain.parallelisms.mesh import Meshes


@dataclass(frozen=True)
class Place:
    """Where a rank runs: the layout's degrees, its meshes and its device."""

    dims: ParallelDims
    meshes: Meshes
    device: torch.device


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LayoutError("train.device=cuda but no CUDA device is visible; use cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's shared store
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = round_store(rank, world_size, ROUND_STORE_TIMEOUT)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, device_id=device_id
        )
    elif "RANK" in os.environ:  # launched by torchrun without a shared store, or by the tests
        dist.init_process_group(backend, device_id=device_id)
    else:  # plain `python train.py`: a world of one, so the code path stays the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# How long ranks wait for rank 0 to announce the round's store (torch's default for gloo).
ROUND_STORE_TIMEOUT = timedelta(minutes=30)
# Where rank 0 announces it, in torchrun's shared store.
ROUND_STORE_KEY = "moetrain/round_store"
# One try at an announced store: a live one answers in milliseconds.
_PROBE = timedelta(seconds=1)


def round_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A store of this round's own, hosted by rank 0, found through torchrun's shared store.

    NOTE: torchrun's agent hosts one TCPStore (MASTER_ADDR:MASTER_PORT) that outlives its
    workers and is handed, unprefixed, to every round of them. The process group writes the
    same keys in every round, so after an in-place restart (`--max-restarts`, or a node
    joining) a new rank could read a dead rank's gloo address (or NCCL id) from the round
    before: it connected to a closed port, or both ranks waited for each other, inside the
    new group's first connection (pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT is no
    round id: each agent counts only its own failures, so nodes disagree after one failed.
    So rank 0 starts a fresh store each round and announces it with a random token. An
    announcement left by a dead round names a server that died with its rank 0 (refused)
    or, should the port have been reused, one without that token: the other ranks retry
    until they reach this round's.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        store.set("token", token)
        # NOTE: rank 0's own host, not MASTER_ADDR: with c10d rendezvous the agent's store
        # may live on another node than global rank 0.
        where = {"host": socket.getfqdn(), "port": store.port, "token": token}
        agent.set(ROUND_STORE_KEY, json.dumps(where))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        announced = json.loads(agent.get(ROUND_STORE_KEY))  # waits for the first round's
        try:
            store = dist.TCPStore(announced["host"], announced["port"], world_size, timeout=_PROBE)
            if store.get("token").decode() == announced["token"]:
                store.set_timeout(timeout)
                return store
        except dist.DistError:  # a dead round's server: gone, or not answering in time
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: rank 0 did not announce this round's store within {timeout}"
            )
        time.sleep(0.05)
