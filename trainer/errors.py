"""The errors that mean "this run cannot start as asked": each names the file or key and
the fix. Entry points (`train.py`, `python -m trainer.dry_run`) catch exactly these and
exit 2 with the message; anything else is a bug and keeps its traceback."""

from models import HFFormatError
from parallelisms.mesh import LayoutError
from parallelisms.plan import PlanError
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.data import DataError

USER_ERRORS = (ConfigError, LayoutError, DataError, HFFormatError, PlanError, CheckpointError)
