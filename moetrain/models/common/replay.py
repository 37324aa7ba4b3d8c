"""Replayed forwards: a forward that repeats one already run, to rebuild what it computed.

Activation checkpointing drops a block's activations after its forward and, during
backward, runs the block's forward again to rebuild them. That second run must compute the
same values and change no state: a module that keeps a record of its training forwards (a
router's assignment counts) records the first run only. The code that replays a forward
(`moetrain.parallelisms.activation_checkpoint`) runs it inside `replay()`; modules ask `is_replay()`,
or `recording(module)`, which also leaves out eval probes and no-grad forwards.

The flag is per thread: a replay runs inside the backward, on the thread that executes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_local = threading.local()


def is_replay() -> bool:
    """Whether the forward running now repeats one already run (and recorded)."""
    return getattr(_local, "depth", 0) > 0


def recording(module: nn.Module) -> bool:
    """Whether `module`'s forward running now is a training forward to record: in training
    mode, with autograd on (not an eval probe) and not a replay of one already recorded."""
    return module.training and torch.is_grad_enabled() and not is_replay()


@contextmanager
def replay() -> Iterator[None]:
    """Run a forward as a replay: same values, no state recorded twice."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
