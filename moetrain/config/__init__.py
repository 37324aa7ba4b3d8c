"""Typed job configuration: `train.py`'s TOML sections and `--section.key=value` overrides.

- `schema`: one dataclass per section, each field with its doc and allowed values;
- `load`: defaults < TOML < command line, typed conversion, `validate`, `ConfigError`;
- `checks`: the value checks `validate` runs (field bounds, then cross-field rules);
- `help`: `format_help` for `--help`, `config_to_dict` for the run's logged config;
- `notes`: the accepted values that do nothing in this run, as console lines.
"""

from moetrain.config.help import config_to_dict, format_help
from moetrain.config.load import ConfigError, load_config, validate
from moetrain.config.notes import moment_dtype_notes, resume_notes, startup_notes
from moetrain.config.schema import (
    CheckpointSection,
    DataSection,
    DebugSection,
    EvalSection,
    JobConfig,
    JobSection,
    MetricsSection,
    MixSource,
    ModelSection,
    MoESection,
    ParallelSection,
    ProfileSection,
    TrainSection,
)

__all__ = [
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "DebugSection",
    "EvalSection",
    "JobConfig",
    "JobSection",
    "MetricsSection",
    "MixSource",
    "MoESection",
    "ModelSection",
    "ParallelSection",
    "ProfileSection",
    "TrainSection",
    "config_to_dict",
    "format_help",
    "load_config",
    "moment_dtype_notes",
    "resume_notes",
    "startup_notes",
    "validate",
]
