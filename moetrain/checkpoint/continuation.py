"""A continuation: a new run that starts from another run's checkpoint (`checkpoint.init_from`).

A continuation takes an earlier run's weights (and, with `checkpoint.init_optimizer`, its Adam
moments) and then trains as a run of its own: this run's data or blend, `data.seq_len`,
schedule and step count, from step 0 with a fresh data order. It is how a long-context
extension or an anneal follows the main run (torchtitan's `initial_load_path`, Megatron's
`--finetune`).

What a continuation may change of the model: any `[model]` value that keeps every tensor's shape
(RoPE's base, YaRN scaling for a longer context, the aux-loss weight), stated at start-up;
a change of shape is refused by tensor and key before any process group exists. LoRA
adapters the checkpoint lacks start fresh; adapters it holds that this run lacks are
refused (merge them into the base first).

The checkpoint is used only to start: once this job has checkpoints of its own,
`checkpoint.resume=auto` resumes them, so a continuation stopped mid-way goes on exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.checkpoint.frozen_base import check_base, recorded_base
from moetrain.checkpoint.markers import find_checkpoint, read_trainer_state
from moetrain.config import ConfigError, JobConfig, config_to_dict
from moetrain.errors import CheckpointError
from moetrain.models.common.lora import is_adapter

# What a continuation may not change: the keys that pick which model is built.
_IDENTITY = ("name",)


@dataclass
class Continuation:
    """The checkpoint a continuation starts from, and what it says at start-up."""

    path: str
    state: dict[str, Any]  # its trainer state (config, frozen_saved, ...)
    notes: list[str]


def saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of checkpoint `path` by its state-dict key ("model.<fqn>",
    "optim.state.<fqn>.exp_avg", ...) -> its global shape: DCP's index alone, no data read."""
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in index.items() if isinstance(v, TensorStorageMetadata)}


def model_changes(state: dict, cfg: JobConfig) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this run's) for each `[model]` value the continuation changes."""
    saved = state.get("config", {}).get("model", {})
    ours = config_to_dict(cfg)["model"]
    return [
        (k, saved[k], ours[k])
        for k in ours
        if k in saved and k != "init_from_hf" and saved[k] != ours[k]
    ]


def check_continuation_keys(cfg: JobConfig) -> None:
    """The `checkpoint.init_*` keys against the others, whether or not this launch resumes."""
    ck = cfg.checkpoint
    if ck.init_from is None and ck.init_optimizer:
        raise ConfigError(
            "checkpoint.init_optimizer=true takes the optimizer state of "
            "checkpoint.init_from, which is not set; set it, or drop init_optimizer"
        )
    if ck.init_from is not None and ck.resume not in ("auto", "none"):
        raise ConfigError(
            f"checkpoint.resume={ck.resume} and checkpoint.init_from={ck.init_from} are both "
            "set: resume continues a run with all its state, init_from starts a continuation "
            "from a checkpoint's weights; keep one"
        )


def resolve_continuation(cfg: JobConfig) -> Continuation | None:
    """The checkpoint `checkpoint.init_from` names (a step directory, or a job's output or
    checkpoints directory: its newest complete checkpoint), checked complete; None unset."""
    ck = cfg.checkpoint
    if ck.init_from is None:
        return None
    path, chosen = find_checkpoint(ck.init_from, "checkpoint.init_from")
    continuation = Continuation(path, read_trainer_state(path), [chosen] if chosen else [])
    changes = model_changes(continuation.state, cfg)
    what = "; ".join(f"model.{k}: {a!r} -> {b!r}" for k, a, b in changes)
    continuation.notes.append(
        f"continuation of {path} (step {continuation.state['step']}): its weights"
        f"{' and optimizer moments' if ck.init_optimizer else ''}, then this run's data and "
        f"schedule from step 0{f'; {what} (every tensor keeps its shape)' if what else ''}"
    )
    return continuation


def check_continuation(continuation: Continuation, cfg: JobConfig, model: nn.Module) -> None:
    """Refuse a continuation whose checkpoint cannot fill `model` (this run's model on the meta
    device, adapters applied): another model, another shape, adapters this run lacks, or
    optimizer moments it does not hold."""
    path, where = continuation.path, f"checkpoint.init_from={continuation.path}"
    changes = model_changes(continuation.state, cfg)
    changed = "; ".join(f"model.{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in changes)
    if any(k in _IDENTITY for k, _, _ in changes):
        raise CheckpointError(f"{where} holds another model than this run's ({changed})")
    saved = saved_shapes(path)
    frozen_saved = continuation.state.get("frozen_saved", True)
    if not frozen_saved:  # LoRA's adapters alone: the base comes from where its run took it
        check_base(path, recorded_base(path, continuation.state), cfg)
    params = dict(model.named_parameters())
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in ours.items():
        key = f"model.{name}"
        if key not in saved:
            trained = name in params and params[name].requires_grad
            if is_adapter(name) or (not frozen_saved and not trained):
                continue  # new adapters start fresh; an adapters-only checkpoint's base
            raise CheckpointError(
                f"{where} has no {name}, which this run's model has"
                f"{f' ({changed})' if changed else ''}: it is another architecture; start "
                "from a checkpoint of this model"
            )
        if saved[key] != shape:
            raise CheckpointError(
                f"{where}: {name} is {list(saved[key])} there but {list(shape)} in this "
                f"run ({changed or 'the [model] keys are equal: check [peft]'}); a continuation may "
                "change only what keeps every tensor's shape: set those keys as the checkpoint "
                "has them"
            )
    extra = sorted(k[len("model.") :] for k in saved if k.startswith("model."))
    extra = [k for k in extra if k not in ours]
    if extra:
        kind = "LoRA adapters" if is_adapter(extra[0]) else "tensors"
        fix = (
            "set [peft] as its run had it, or merge them into the base (python -m "
            "moetrain.export) and start from that with model.init_from_hf"
            if is_adapter(extra[0])
            else "start from a checkpoint of this model"
        )
        raise CheckpointError(
            f"{where} holds {kind} this run's model lacks ({extra[0]}, {len(extra)} in all): {fix}"
        )
    if cfg.checkpoint.init_optimizer:
        lacking = [
            n for n, p in params.items() if p.requires_grad and f"optim.state.{n}.step" not in saved
        ]
        if lacking:
            raise CheckpointError(
                f"checkpoint.init_optimizer=true, but {where} holds no optimizer state for "
                f"{lacking[0]} ({len(lacking)} trained tensors in all: its run did not train "
                "them); leave checkpoint.init_optimizer off"
            )


def check_stage_objective(continuation: Continuation, cfg: JobConfig) -> None:
    """A DPO stage takes its reference from the frozen base with the adapters off: from a
    checkpoint that holds trained LoRA adapters that would be the model before them, not the
    one the stage starts from."""
    peft = continuation.state.get("config", {}).get("peft", {}).get("method")
    if cfg.train.objective == "dpo" and peft == "lora":
        raise ConfigError(
            f"checkpoint.init_from={continuation.path} holds LoRA adapters, and "
            "train.objective=dpo takes its reference from the frozen base with the adapters "
            "off, which would not be the model this stage starts from; export that checkpoint "
            "merged (python -m moetrain.export) and start from the export (model.init_from_hf)"
        )
