"""What a save writes to the disk: the room it needs (its bytes over all ranks, or the
previous checkpoint's size if larger: a save without room is refused before writing), and
one line saying why a write failed (disk full, a write error, a peer gone), for the message
of a save that is then removed (moetrain.checkpoint.checkpointer: a failed save loses nothing).
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor


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
