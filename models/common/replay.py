"""Replayed forwards: a forward that repeats one already run, to rebuild what it computed.

Activation checkpointing drops a block's activations after its forward and, during
backward, runs the block's forward again to rebuild them. That second run must compute the
same values and change no state: a module that keeps a record of its training forwards (a
router's assignment counts) records the first run only. The code that replays a forward
(`parallelisms.activation_checkpoint`) runs it inside `replay()`; modules ask `is_replay()`.

The flag is per thread: a replay runs inside the backward, on the thread that executes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def is_replay() -> bool:
    """Whether the forward running now repeats one already run (and recorded)."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def replay() -> Iterator[None]:
    """Run a forward as a replay: same values, no state recorded twice."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
