"""Model registry: a name in `[model] name = ...` -> what the trainer needs to build it.

A model is plain PyTorch. Its folder provides the `nn.Module`, a hyper-parameter
dataclass, a declarative parallel plan (`models.common.plan.ParallelPlan`) and a
Hugging Face adapter. Adding a model means adding one entry here; trainer and
parallelism code do not change.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any


class HFFormatError(ValueError):
    """A Hugging Face checkpoint directory this model cannot read; names what and why."""


def read_config_json(model_dir: str) -> dict:
    """The config.json of a Hugging Face model directory (for the adapters' load_hf_config)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise HFFormatError(f"no config.json in {model_dir!r} (model.init_from_hf)")
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_cls: type  # dataclass of hyper-parameters, its fields are the `[model]` keys
    model_cls: type  # nn.Module built as model_cls(args)
    plan: Any  # models.common.plan.ParallelPlan
    # Module with load_hf_config, hf_config_dict, hf_keys, from_hf, to_hf, is_redundant_key.
    hf_adapter: Any


# name -> module path whose `SPEC` attribute is the ModelSpec (imported on demand).
_REGISTRY = {"deepseek_v3": "models.deepseek_v3", "qwen3_moe": "models.qwen3_moe"}


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(model_names())}")
    return importlib.import_module(_REGISTRY[name]).SPEC
