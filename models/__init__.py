"""Model registry: a name in `[model] name = ...` -> the model's `ModelSpec`.

A model is plain PyTorch. Its folder exports `SPEC`, a `models.spec.ModelSpec`: the
typed contract (constructor, parallel plan, loss terms, FLOPs, HF adapter) through which
the trainer reads it. Adding a model means adding one entry to `_REGISTRY`; trainer and
parallelism code do not change.
"""

from __future__ import annotations

import importlib
import json
import os

from models.spec import HFAdapter, LossTerms, ModelSpec


class HFFormatError(ValueError):
    """A Hugging Face checkpoint directory this model cannot read; names what and why."""


def read_config_json(model_dir: str) -> dict:
    """The config.json of a Hugging Face model directory (for the adapters' load_hf_config)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise HFFormatError(f"no config.json in {model_dir!r} (model.init_from_hf)")
    with open(path) as f:
        return json.load(f)


__all__ = ["HFAdapter", "HFFormatError", "LossTerms", "ModelSpec", "get_model_spec", "model_names"]

# name -> module path whose `SPEC` attribute is the ModelSpec (imported on demand).
_REGISTRY = {
    "deepseek_v3": "models.deepseek_v3",
    "olmoe": "models.olmoe",
    "qwen3_moe": "models.qwen3_moe",
}


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(model_names())}")
    return importlib.import_module(_REGISTRY[name]).SPEC
