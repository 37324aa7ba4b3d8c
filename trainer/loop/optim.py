"""AdamW and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import TrainSection


def build_optimizer(model: nn.Module, cfg: TrainSection) -> torch.optim.AdamW | None:
    """AdamW; 1-D parameters (norm weights, biases) get no weight decay. None when `model`
    trains no parameter: a pipeline stage whose parameters LoRA all froze (e.g. a dense
    first layer with adapters on the experts alone), which torch's optimizers refuse.

    NOTE: parameters are grouped by device mesh too: the foreach kernels take one list per
    group, and DTensor refuses one op over tensors of different meshes (dense params live
    on the FSDP mesh, routed experts on the (efsdp, ep) mesh).
    """
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:  # frozen (LoRA's base): no state, no update
            continue
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((p.ndim >= 2, mesh), []).append(p)
    param_groups = [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
        for (decay, _), params in groups.items()
    ]
    if not param_groups:
        return None
    return torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True
    )


def warmup_steps(cfg: TrainSection) -> int:
    """The warmup, clamped to the run: a short smoke run of a real config warms up over
    all its steps instead of being refused."""
    return min(cfg.warmup_steps, cfg.steps)


def lr_factor(step: int, cfg: TrainSection) -> float:
    """Multiplier of cfg.lr for the update made at optimizer step `step` (0-based)."""
    warmup = warmup_steps(cfg)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(cfg.steps - warmup - 1, 1)
        progress = min((step - warmup) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":  # warmup, stable at peak, then linear decay to the floor
        decay_steps = max(int(round(cfg.decay_ratio * cfg.steps)), 1)
        decay_start = cfg.steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start + 1) / decay_steps, 1.0)
        return 1.0 - (1.0 - floor) * progress
    raise ValueError(f"unknown train.schedule {cfg.schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer | None, step: int, cfg: TrainSection) -> float:
    """Set the learning rate of the update made at optimizer step `step`; returns it
    (`optimizer` None: nothing to set, see `build_optimizer`).

    NOTE: a pure function of the step, not an LR-scheduler object: its whole state is the
    step, so a checkpoint resumes it on any layout (whose parameter groups may differ).
    """
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups if optimizer is not None else []:
        group["lr"] = lr
    return lr
