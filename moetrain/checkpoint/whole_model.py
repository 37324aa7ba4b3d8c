"""A training checkpoint's model, outside training: the model spec and args it was trained
with, its model built as it was trained (with LoRA's adapters where it had them), the dtype
each model tensor was saved in, its saved model state (read a chosen set of tensors at a
time), and the whole model on CPU (`load_checkpoint_model`, what generation and the tests
load; a LoRA checkpoint saved without its frozen base gets it from where its run took it).
Both exports (`moetrain.export.merged`, `moetrain.export.adapters`) read through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moetrain.build.model import meta_model
from moetrain.checkpoint.frozen_base import check_base, load_base, recorded_base
from moetrain.checkpoint.markers import check_checkpoint, read_trainer_state
from moetrain.config.moe_peft import PeftSection
from moetrain.models import get_model_spec
from moetrain.models.spec import ModelSpec
from moetrain.parallelisms.sharded_init import named_weights


def checkpoint_spec(path: str) -> tuple[ModelSpec, Any]:
    """The model spec and args a checkpoint was trained with (from its saved config)."""
    check_checkpoint(path)
    config = read_trainer_state(path)["config"]
    model_cfg = dict(config["model"])
    spec = get_model_spec(model_cfg.pop("name"))
    model_cfg.pop("init_from_hf", None)
    return spec, spec.args_cls(**model_cfg)


def checkpoint_model(path: str, spec: ModelSpec, args: Any) -> torch.nn.Module:
    """The model a checkpoint holds, on the meta device: with its LoRA adapters when it was
    trained with them (`[peft]` of its saved config)."""
    peft = read_trainer_state(path)["config"].get("peft", {})
    return meta_model(spec, args, PeftSection(**peft) if peft else None)


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


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, ModelSpec, Any]:
    """The trained model of checkpoint `path`, whole and unsharded on CPU, its spec and args
    (for tests and small models; `export_checkpoint` streams instead)."""
    spec, args = checkpoint_spec(path)
    model = checkpoint_model(path, spec, args)
    model.to_empty(device="cpu")  # no init: every weight comes from the checkpoint
    state = model.state_dict()
    if not read_trainer_state(path).get("frozen_saved", True):  # LoRA adapters alone
        with torch.no_grad():
            for name, value in frozen_base(path, spec, args).items():
                state.pop(name).copy_(value)
        state.update({n: b for n, b in model.named_buffers()})  # saved all the same
    read_model_state(path, state)
    return model.eval(), spec, args


def frozen_base(path: str, spec: ModelSpec, args: Any) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA checkpoint saved without it, whole on CPU: the weights its
    run started from (`moetrain.checkpoint.frozen_base`), refused if they are gone or changed."""
    base = recorded_base(path, read_trainer_state(path))
    check_base(path, base)
    model = meta_model(spec, args)
    model.to_empty(device="cpu")  # every weight comes from the base
    load_base(base, model, spec, args, whole=None)
    return dict(named_weights(model))
