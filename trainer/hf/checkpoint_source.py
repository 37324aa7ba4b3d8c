"""What both exports read from a training checkpoint (`trainer.hf.export`, the merged
weights; `trainer.hf.peft_export`, the adapters alone): the model spec and args it was
trained with, its model built as it was trained (with LoRA's adapters where it had them),
the dtype each model tensor was saved in, and its saved model state, read a chosen set of
tensors at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from models import get_model_spec
from models.spec import ModelSpec
from trainer.checkpoint.markers import check_checkpoint, read_trainer_state
from trainer.config.moe_peft import PeftSection


def checkpoint_spec(path: str) -> tuple[ModelSpec, Any]:
    """The model spec and args a checkpoint was trained with (from its saved config)."""
    check_checkpoint(path)
    config = read_trainer_state(path)["config"]
    model_cfg = dict(config["model"])
    spec = get_model_spec(model_cfg.pop("name"))
    model_cfg.pop("init_from_hf", None)
    return spec, spec.args_cls(**model_cfg)


def build_model(path: str, spec: ModelSpec, args: Any) -> torch.nn.Module:
    """The model a checkpoint holds, on the current device: with its LoRA adapters when it
    was trained with them (`[peft]` of its saved config)."""
    model = spec.build(args)
    peft = read_trainer_state(path)["config"].get("peft", {})
    if peft.get("method", "none") == "lora":
        from trainer.loop.peft import apply_lora

        apply_lora(model, spec.plan, PeftSection(**peft), spec.name)
    return model


def read_model_state(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (native name -> global-size tensor) from the checkpoint's model state;
    only those tensors are read."""
    dcp.load(
        {"model": tensors},
        checkpoint_id=path,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )


def saved_dtypes(path: str, names: list[str]) -> dict[str, torch.dtype]:
    """The dtype the checkpoint holds each model tensor of `names` in (what training kept it
    in: an fp32 master under bf16 compute), from its metadata; no tensor data is read."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    return {name: saved[f"model.{name}"].properties.dtype for name in names}
