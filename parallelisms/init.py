"""Layout-independent weight initialisation and loading of full tensors into shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from models.common.init import param_generator


def local_index(param: torch.Tensor) -> tuple[slice, ...]:
    """The region of the global tensor that this rank holds of `param`, a slice per dim."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    # NOTE: a private helper, but it is the one DTensor itself uses for this question.
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The slice of the global value `full` that this rank holds of `param`.

    Works for any placements (FSDP Shard(0), EP Shard(0) x FSDP Shard(1), HSDP ...), uneven
    shards included, because DTensor itself says where the local shard starts.
    """
    return full[local_index(param)]


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the global value `full` into `param`'s local storage (no communication)."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(full.shape)}")
    local = param.to_local() if isinstance(param, DTensor) else param
    local.copy_(local_part(full, param).to(local.dtype))


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (e.g. a router's correction bias): what a model's
    initialisation, HF import and export handle. Buffers stay plain, replicated tensors."""
    return [*model.named_parameters(), *model.named_buffers()]


@torch.no_grad()
def init_weights_global(model: nn.Module, seed: int) -> None:
    """Initialise every parameter and buffer as the unsharded model would be, then keep
    the local part.

    Each rank materialises one full parameter at a time (on its device) from a per-name
    RNG stream, so the same seed gives the same global weights on any layout. Costs one
    transient full-size tensor per parameter.
    """
    for name, param in named_weights(model):
        device = param.device
        full = torch.empty(param.shape, dtype=torch.float32, device=device)
        model.reset_parameter(name, full, param_generator(seed, name, device))
        copy_full_(param, full)
