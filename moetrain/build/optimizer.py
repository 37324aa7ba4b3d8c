"""AdamW and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.build.adamw_bf16 import STATE_DTYPES, AdamWLowPrecisionState
from moetrain.config import TrainSection

# NOTE: the devices torch ships a fused AdamW kernel (`torch._fused_adamw_`) for, among
# those a run can use (train.device): any floating dtype on either. torch refuses
# fused=True elsewhere (`_device_dtype_check_for_fused`), so `fused_unsupported` asks
# before building.
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def fused_unsupported(params: list[nn.Parameter], device: str | None = None) -> str | None:
    """Why torch has no fused AdamW for `params` ("torch.bfloat16 on mps"), None when it has one.
    `device`: the device type they will live on, where it is not theirs yet (the dry-run
    planner's meta shards stand for the launch's parameters)."""
    for p in params:
        where = device or p.device.type
        if where not in FUSED_ADAMW_DEVICES or not p.is_floating_point():
            return f"{p.dtype} on {where}"
    return None


def build_optimizer(
    model: nn.Module, cfg: TrainSection, device: str | None = None
) -> torch.optim.AdamW | None:
    """AdamW; 1-D parameters (norm weights, biases) get no weight decay. None when `model`
    trains no parameter: a pipeline stage whose parameters LoRA all froze (e.g. a dense
    first layer with adapters on the experts alone), which torch's optimizers refuse.
    `train.optimizer_impl=fused` builds the fused kernels where torch has them for the
    parameters (`fused_unsupported`; `device` as there), foreach elsewhere;
    `optimizer_impl` says which it built. `train.optimizer_state_dtype=bf16`: moments in
    bf16 (moetrain.build.adamw_bf16), whatever `optimizer_impl` says.

    NOTE: parameters are grouped by device mesh too: the foreach kernels take one list per
    group, and DTensor refuses one op over tensors of different meshes (dense params live
    on the FSDP mesh, routed experts on the (efsdp, ep) mesh). The fused kernel runs on
    each group's local shards the same way (DTensor dispatches `_fused_adamw_` as a
    foreach op).
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
    trained = [p for params in groups.values() for p in params]
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if cfg.optimizer_state_dtype != "fp32":  # moments stored narrower than the parameters
        return AdamWLowPrecisionState(
            param_groups, STATE_DTYPES[cfg.optimizer_state_dtype], **hyper
        )
    fused = cfg.optimizer_impl == "fused" and fused_unsupported(trained, device) is None
    return torch.optim.AdamW(
        param_groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """The kernels `optimizer` (from `build_optimizer`) runs: "fused", "foreach" or
    "per-parameter" (bf16 moments)."""
    if isinstance(optimizer, AdamWLowPrecisionState):
        return "per-parameter"
    return "fused" if optimizer.defaults.get("fused") else "foreach"


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
