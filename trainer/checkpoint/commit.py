"""What a save needs besides DCP: room on the disk, every rank's checksums, and a clear
message when it fails.

Invariant: a failed save loses nothing. Before writing, the save is refused if the disk
lacks the room the state needs (its bytes over all ranks, or the previous checkpoint's size
if larger); a save that fails while writing (disk full, a write error, a peer gone) is
removed, so the newest complete checkpoint stays the one a relaunch resumes from.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from trainer.errors import CheckpointError

# How long rank 0 waits for a peer's checksums before giving up on the commit, how long
# before it says whom it is waiting for, and how long once SIGTERM came.
SUMS_TIMEOUT_S = 600.0
SUMS_SAY_AFTER_S = 30.0
# NOTE: not zero: SIGTERM also starts the preemption save, whose healthy peers are still
# hashing; below torchrun's 30 s grace, after which its SIGKILL ends every wait anyway.
SUMS_SIGTERM_GRACE_S = 20.0


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def local_state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: its share of the files."""
    if isinstance(state, dict):
        return sum(local_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(local_state_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def directory_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def cause_of(err: BaseException) -> str:
    """One line saying why a write failed: the OS error if there is one, else the first
    line of the message (DCP wraps each rank's error in a CheckpointException)."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            name = errno.errorcode.get(seen.errno, str(seen.errno))
            return f"{seen.strerror} ({name})"
        seen = seen.__cause__ or seen.__context__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def gather_sums(
    tmp: str,
    world: int,
    stop_requested: Callable[[], bool],
    timeout: float = SUMS_TIMEOUT_S,
    say_after: float = SUMS_SAY_AFTER_S,
    grace: float = SUMS_SIGTERM_GRACE_S,
) -> dict[str, str]:
    """Every rank's `.sums-<rank>.json` in `tmp`, merged, once all are there.

    The wait is bounded (`timeout`), says after `say_after` seconds which ranks it waits for,
    and after SIGTERM (`stop_requested`) lasts at most `grace` more seconds: a peer that died
    before writing its checksums makes torchrun stop the job, and the commit must give up
    within torchrun's grace period.
    """
    paths = [os.path.join(tmp, f".sums-{r}.json") for r in range(world)]
    start, said, signalled = time.monotonic(), False, None
    while missing := [r for r, p in enumerate(paths) if not os.path.isfile(p)]:
        now = time.monotonic()
        if signalled is None and stop_requested():
            signalled = now
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
        if now - start > timeout or (signalled is not None and now - signalled > grace):
            why = "SIGTERM came" if signalled is not None else f"{timeout:.0f} s passed"
            raise CheckpointError(
                f"{tmp}: {why} while waiting for {who} to write its checksums (the rank died "
                "or hangs); this save was not committed"
            )
        if now - start > say_after and not said:
            print(f"checkpoint commit: waiting for {who} to write its checksums", file=sys.stderr)
            said = True
        time.sleep(0.05)
    files: dict[str, str] = {}
    for p in paths:
        with open(p) as f:
            files.update(json.load(f))
        os.remove(p)
    return files
