"""Model registry: a name in `[model] name = ...` -> the model's `ModelSpec`.

A model is plain PyTorch. Its folder holds `args.py` (the hyper-parameter dataclass, no
torch) and `spec.py`, whose `SPEC` is a `moetrain.models.spec.ModelSpec`: the typed contract
(constructor, parallel plan, loss terms, FLOPs, HF adapter) through which the trainer reads
it. Adding a model means adding one entry to `_REGISTRY`; trainer and parallelism code do
not change.

NOTE: nothing here imports torch, and `model_args_class` imports only a model's `args.py`:
the job config is loaded and checked without torch, so a refused launch answers at once.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetrain.models.spec import ModelSpec


class HFFormatError(ValueError):
    """A Hugging Face checkpoint directory this model cannot read; names what and why."""


def read_config_json(model_dir: str) -> dict:
    """The config.json of a Hugging Face model directory (for the adapters' load_hf_config)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise HFFormatError(f"no config.json in {model_dir!r} (model.init_from_hf)")
    with open(path) as f:
        return json.load(f)


__all__ = ["HFFormatError", "get_model_spec", "model_args_class", "model_names"]

# name -> (package, the name of its hyper-parameter dataclass in `<package>.args`).
_REGISTRY = {
    "deepseek_v3": ("moetrain.models.deepseek_v3", "DeepseekV3Args"),
    "ernie4_5_moe": ("moetrain.models.ernie4_5_moe", "Ernie45MoeArgs"),
    "glm4_moe": ("moetrain.models.glm4_moe", "Glm4MoeArgs"),
    "gpt_oss": ("moetrain.models.gpt_oss", "GptOssArgs"),
    "mixtral": ("moetrain.models.mixtral", "MixtralArgs"),
    "olmoe": ("moetrain.models.olmoe", "OlmoeArgs"),
    "qwen2_moe": ("moetrain.models.qwen2_moe", "Qwen2MoeArgs"),
    "qwen3_moe": ("moetrain.models.qwen3_moe", "Qwen3MoeArgs"),
}


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def _entry(name: str) -> tuple[str, str]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(model_names())}")
    return _REGISTRY[name]


def get_model_spec(name: str) -> ModelSpec:
    """The model's whole contract (imports torch and the model)."""
    return importlib.import_module(f"{_entry(name)[0]}.spec").SPEC


def model_args_class(name: str) -> type:
    """The model's hyper-parameter dataclass alone (no torch): what the config needs."""
    package, cls = _entry(name)
    return getattr(importlib.import_module(f"{package}.args"), cls)
