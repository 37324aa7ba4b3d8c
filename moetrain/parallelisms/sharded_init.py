"""Layout-independent weight initialisation, shard by shard, and where a rank's shard lies."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.models.common.lora import is_adapter
from moetrain.models.common.weight_init import TILE_ELEMS, init_tiles, tile_generator


def local_index(param: torch.Tensor) -> tuple[slice, ...]:
    """The region of the global tensor that this rank holds of `param`, a slice per dim."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    # NOTE: a private helper, but it is the one DTensor itself uses for this question.
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (e.g. a router's correction bias): what a model's
    initialisation, HF import and export handle. Buffers stay plain, replicated tensors.
    LoRA adapters are not the model's weights: `moetrain/build/lora.py` handles them."""
    params = [(n, p) for n, p in model.named_parameters() if not is_adapter(n)]
    return [*params, *model.named_buffers()]


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """The intersection of two boxes (a slice per dim, step 1), None when empty."""
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(s.start >= s.stop for s in out) else out


def _shift(box: tuple[slice, ...], origin: tuple[slice, ...]) -> tuple[slice, ...]:
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(box, origin))


# reset(name, tile, generator): fill `tile` (a region of the full tensor `name`) in place.
Reset = Callable[[str, torch.Tensor, torch.Generator], None]


@torch.no_grad()
def init_weights_global(
    model: nn.Module,
    seed: int,
    tile_elems: int = TILE_ELEMS,
    weights: list[tuple[str, torch.Tensor]] | None = None,
    reset: Reset | None = None,
) -> None:
    """Give every parameter and buffer the values the unsharded model would get
    (`moetrain.models.common.weight_init.init_all_`), holding at most one tile beyond the local shard.
    `weights` and `reset`: other tensors (default: `named_weights`) and their fill
    (default: the model's `reset_parameter`), e.g. LoRA adapters.

    Each rank generates only the tiles that meet its shard (`init_tiles`: fixed by the
    global shape, each from its own stream), so the same seed gives the same global weights
    on any layout, and no rank draws or holds a full expert stack or embedding.
    """
    reset = reset or model.reset_parameter
    for name, param in weights if weights is not None else named_weights(model):
        local = param.to_local() if isinstance(param, DTensor) else param
        mine = local_index(param)
        tiles = init_tiles(tuple(param.shape), tile_elems)
        for k, tile in enumerate(tiles):
            common = _overlap(tile, mine)
            if common is None:
                continue
            values = torch.empty(
                tuple(s.stop - s.start for s in tile), dtype=torch.float32, device=local.device
            )
            reset(name, values, tile_generator(seed, name, k, len(tiles), local.device))
            local[_shift(common, mine)] = values[_shift(common, tile)].to(local.dtype)
