"""`peft.init_from`: this run's LoRA adapters start from a peft adapter directory (this
project's `--adapters` export, or peft's own `save_pretrained`) instead of the fresh init.

Its `r`, `lora_alpha` and targets must be this run's: the adapters would otherwise compute
another update than the one peft computed with them. Each rank copies its own shard of each
adapter from the file's global tensor (`local_index`), so any layout reads any file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.config import ConfigError
from moetrain.config.moe_peft import PeftSection
from moetrain.hf.peft_format import CONFIG, PREFIX, WEIGHTS, peft_layout
from moetrain.parallelisms.sharded_init import local_index


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS)):
        raise ConfigError(
            f"peft.init_from={directory} is not a peft adapter directory ({CONFIG} and "
            f"{WEIGHTS}): point it at an `--adapters` export or a peft save_pretrained"
        )
    with open(path) as f:
        return json.load(f)


@torch.no_grad()
def load_peft_adapters(
    model: nn.Module, whole: nn.Module, adapter: Any, args: Any, peft: PeftSection
) -> None:
    """Fill `model`'s adapters (this rank's shards) from `peft.init_from`; `whole` is the
    whole model (a pipeline stage holds only some of the adapters the file must have)."""
    directory = peft.init_from
    config = _read_config(directory)
    theirs = {"rank": config.get("r"), "alpha": config.get("lora_alpha")}
    for key, value in theirs.items():
        if value != getattr(peft, key):
            raise ConfigError(
                f"peft.init_from={directory} was trained with peft.{key}={value}, this run has "
                f"peft.{key}={getattr(peft, key)}: set peft.{key}={value}"
            )
    want = peft_layout(whole, adapter, args).entries
    with safe_open(os.path.join(directory, WEIGHTS), framework="pt") as f:
        have = {k.removeprefix(PREFIX) for k in f.keys()}
        missing, extra = sorted(want.keys() - have), sorted(have - want.keys())
        if missing or extra:
            raise ConfigError(
                f"peft.init_from={directory} adapts other weights than peft.targets="
                f"{peft.targets} (it lacks {missing[:2]}, has {extra[:2]} besides): set "
                "peft.targets to the targets it was trained with"
            )
        params = dict(model.named_parameters())
        for key, entry in want.items():
            param = params.get(entry.native)
            if param is None:  # another pipeline stage's
                continue
            full = entry.from_peft(f.get_tensor(PREFIX + key))
            if tuple(full.shape) != tuple(param.shape):
                raise ConfigError(
                    f"peft.init_from={directory}: {key} is {tuple(full.shape)} where this "
                    f"model's adapter is {tuple(param.shape)}: another model's adapters"
                )
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(full[local_index(param)].to(local.dtype))
