"""The errors that mean "this run cannot start (or go on) as asked": each names the file or
key and the fix. Entry points (`train.py`, `python -m trainer.dry_run`, the commands) catch
exactly these and exit 2 with the message; anything else is a bug and keeps its traceback.

NOTE: torch-free, like every module `train.py` needs to accept or refuse a config, so that a
refused launch answers in a fraction of a second instead of after torch's import.
"""

from models import HFFormatError
from parallelisms.dims import LayoutError
from parallelisms.plan import PlanError
from trainer.config.load import ConfigError


class DataError(Exception):
    """A data configuration or data content problem, worded for the person writing the config."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (or written); the message names it and why."""


USER_ERRORS = (ConfigError, LayoutError, DataError, HFFormatError, PlanError, CheckpointError)
