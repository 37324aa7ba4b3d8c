"""The errors that mean "this run cannot start (or go on) as asked": each names the file or
key and the fix. Entry points (`train.py`, `python -m moetrain.planner`, the commands) catch
exactly these and exit 2 with the message; anything else is a bug and keeps its traceback.

NOTE: torch-free, like every module `train.py` needs to accept or refuse a config, so that a
refused launch answers in a fraction of a second instead of after torch's import.
"""

import os
import sys
import time

from moetrain.config.load import ConfigError
from moetrain.models import HFFormatError
from moetrain.parallelisms.dims import LayoutError
from moetrain.parallelisms.plan import PlanError


class DataError(Exception):
    """A data configuration or data content problem, worded for the person writing the config."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (or written); the message names it and why."""


USER_ERRORS = (ConfigError, LayoutError, DataError, HFFormatError, PlanError, CheckpointError)

# How long ranks other than 0 hold back their refusal (see `refuse`).
QUIET_S = 5.0


def refuse(err: Exception, code: int = 2) -> int:
    """Print the refusal of a command that torchrun may have started on many ranks, once,
    and return its exit code (2: bad input; 3: too many bad steps).

    NOTE: under torchrun, the first rank to exit with an error makes torchrun stop the
    others, perhaps before they print. If only rank 0 printed, its message would be lost
    whenever another rank exited first. So every rank prints, but ranks other than 0 wait
    a moment first: when all ranks refuse the same input (the usual case), rank 0 prints
    once and exits, and torchrun stops the rest; when only this rank failed, it still
    prints.
    """
    if os.environ.get("RANK", "0") != "0":
        time.sleep(QUIET_S)
    print(f"error: {err}", file=sys.stderr, flush=True)
    return code
