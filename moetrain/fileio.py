"""Files the trainer writes whole: replaced atomically (write beside, fsync, rename), so that
a reader, or a run killed mid-write, sees the old file or the new one, never half of either.
No torch here: `prepare`'s workers use it."""

from __future__ import annotations

import json
import os
from typing import Any


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries (a rename is durable only then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Replace `path` by `text`, whole or not at all."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def read_json(path: str) -> Any:
    """The parsed file, or None where it is missing or not JSON (e.g. cut short by a kill)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
