"""What one rank holds and moves per step, measured without memory (`moetrain.planner`).

- State (`sharded_state`): the model is built on the meta device and the real plan applied
  over a fake process group, so every local shard has the shape a real run gives it.
  Parameters and gradients are FSDP2's padded shards (one size on every rank); the optimizer
  state is what the real optimizer creates for the unpadded local shards, for every rank.
- Update (`update_transient`): the temporaries of the gradient norm, clipping and the
  optimizer step, measured by running them on meta copies of the rank's local shards.
- Activations: `moetrain.planner.activation_trace` (one micro-batch's forward, loss and
  backward run on the meta device under a dispatch mode that follows every storage from its
  creation to its death, with the block's real activation checkpointing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves

from moetrain.planner.meta_trace import (
    MetaShortcuts,
    StorageTimeline,
    live_curve,
    local_tensor,
)


def local_numel_by_rank(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """[world_size] int64: elements of `p`'s local shard on each rank (torch.chunk split of
    every sharded dim, as DTensor does; the last ranks get the short or empty chunks)."""
    if not isinstance(p, DTensor):
        return torch.full((world_size,), p.numel(), dtype=torch.int64)
    ranks = p.device_mesh.mesh  # [mesh dims] -> global rank
    sizes = [torch.full(ranks.shape, s, dtype=torch.int64) for s in p.shape]
    for i, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            n = ranks.shape[i]
            coord = torch.arange(n).view([n if j == i else 1 for j in range(ranks.dim())])
            size = sizes[placement.dim]
            chunk = (size + n - 1) // n
            sizes[placement.dim] = (size - coord * chunk).clamp(min=0).minimum(chunk)
    numel = math.prod(sizes) if sizes else torch.ones(ranks.shape, dtype=torch.int64)
    out = torch.zeros(world_size, dtype=torch.int64)
    out[ranks.flatten()] = torch.broadcast_to(numel, ranks.shape).flatten()
    return out


@dataclass
class ShardedState:
    """Per-rank bytes of the resting training state (lists indexed by global rank)."""

    params: list[int]
    grads: list[int]
    optimizer: list[int]
    update: list[int]  # the temporaries of the norm, clip and optimizer step, above the rest
    frozen: list[int]  # the part of params that does not train (LoRA's base)


def sharded_state(
    optimizer: torch.optim.Optimizer | None,
    world_size: int,
    weight: dict[int, float] | None = None,
    frozen: list[nn.Parameter] = (),
    moment_bytes: int | None = None,  # the moments' bytes per element (optimizer_state_dtype)
) -> ShardedState:
    """Parameter, gradient and optimizer bytes of every rank, from this rank's meta shards
    (the parameters of `optimizer`, a real optimizer over the parallelized meta model).

    Parameters: the storages FSDP2 allocated (every shard padded to the largest, so one
    size on every rank). Gradients: FSDP2 writes them as views of each unit's padded
    reduce-scatter output, in the parameters' dtype: the same bytes. Optimizer: the same
    optimizer class, with the same groups, initialises its state on the meta local
    shards; a state tensor shaped like the shard scales with each rank's unpadded shard,
    any other is counted as is. `weight` (id of a parameter -> factor, default 1): how
    many times a parameter counts, for the blocks `sample_blocks` stands in for. Update:
    `update_transient`, scaled to each rank's unpadded shards as the state is. `frozen`:
    parameters outside the optimizer (LoRA's base): their shards (in the params, and
    apart), no gradient. `optimizer` None: nothing trains, only `frozen` counts."""
    weight = weight or {}
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []

    def storage(tensors) -> float:  # FSDP2 gives every parameter its own padded storage
        return sum(
            weight.get(id(p), 1.0) * local_tensor(p).untyped_storage().nbytes() for p in tensors
        )

    padded, frozen_bytes = storage(params), round(storage(frozen))
    held = [frozen_bytes] * world_size
    if optimizer is None:  # e.g. a pipeline stage's embedding under LoRA, measured alone
        none = [0] * world_size
        return ShardedState(held, none, none, none, held)
    local = {id(p): nn.Parameter(torch.empty_like(local_tensor(p))) for p in params}
    groups = [
        {**_on_meta(g), "params": [local[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    opt = type(optimizer)(groups)
    for q in local.values():
        q.grad = torch.zeros_like(q)
    with MetaShortcuts():
        opt.step()  # meta tensors: initialises the state, computes nothing
    per_rank = torch.zeros(world_size, dtype=torch.float64)
    for p in params:
        q, w = local[id(p)], weight.get(id(p), 1.0)
        for value in opt.state[q].values():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == q.shape and value.numel():
                size = min(value.element_size(), moment_bytes or 8)  # as the run keeps them
                per_rank += local_numel_by_rank(p, world_size) * size * w
            else:
                per_rank += value.untyped_storage().nbytes() * w
    padded = round(padded)
    update = update_transient(optimizer, weight) * per_rank / per_rank[0].clamp(min=1)
    return ShardedState(
        [padded + frozen_bytes] * world_size,
        [padded] * world_size,
        per_rank.round().long().tolist(),
        update.round().long().tolist(),
        held,
    )


def _on_meta(group: dict) -> dict:
    """A group's settings but its parameters, for a copy on meta: foreach (no fused on meta)."""
    rest = {k: v for k, v in group.items() if k != "params"}
    if rest.get("fused"):
        rest.update(fused=None, foreach=True)
    return rest


def update_transient(optimizer: torch.optim.Optimizer, weight: dict[int, float]) -> int:
    """The bytes the update allocates above this rank's parameters, gradients and optimizer
    state at its highest point: the real gradient norm and clipping (`moetrain.parallelisms.clip`)
    and the real optimizer's step, in the trainer's order, on meta copies of this rank's
    local shards, once the state exists.

    NOTE: AdamW's foreach step allocates, per parameter group, a list shaped like the group
    (the second moment's square root, in the state's dtype): with the 2-D weights in one
    group, one more fp32 copy of the rank's parameters while the gradients are alive
    (Qwen3-30B-A3B's 4-block proxy on one H100 peaked there, 58.1 GiB). The fused step
    works in place, so it is not run (torch has no fused kernel on meta); the norm and
    clipping allocate scalars. A parameter that counts `weight` times (`sample_blocks`)
    counts int(weight) times and once more for the fraction left.

    NOTE: what the update allocates depends on each group's bytes per dtype (the foreach
    lists), not on how the bytes are cut into tensors; so each group runs as flat tensors of its largest shard's size
    holding its bytes, not one copy per parameter and sampled block (DeepSeek-V3 on 2,048
    ranks: the same bytes, 0.7 s instead of 4.1 s per layout)."""
    from moetrain.parallelisms.clip import clip_grads_, grad_norm

    groups = []
    for g in optimizer.param_groups:
        elements: dict[torch.dtype, list[int]] = {}  # dtype -> [total, largest]
        for p in g["params"]:
            shard, w = local_tensor(p), weight.get(id(p), 1.0)
            n = shard.numel()
            count = elements.setdefault(shard.dtype, [0, 0])
            count[0] += n * int(w) + round((w - int(w)) * n)
            count[1] = max(count[1], n)
        copies = []
        for dtype, (total, largest) in elements.items():
            whole, rest = divmod(total, max(1, largest))
            copies += [torch.empty(largest, dtype=dtype, device="meta") for _ in range(whole)]
            if rest:
                copies.append(torch.empty(rest, dtype=dtype, device="meta"))
        groups.append({**_on_meta(g), "params": [nn.Parameter(c) for c in copies]})
    opt = type(optimizer)(groups)
    params = [q for g in opt.param_groups for q in g["params"]]
    for q in params:
        q.grad = torch.zeros_like(q)
    with MetaShortcuts():
        opt.step()  # creates the state, which rests from then on like params and gradients
    resting = [*params, *(q.grad for q in params), *tree_leaves(list(opt.state.values()))]
    timeline = StorageTimeline(
        {t.untyped_storage()._cdata for t in resting if isinstance(t, torch.Tensor)}
    )
    with timeline:
        clip_grads_(params, 1.0, grad_norm(params))
        if not any(g.get("fused") for g in optimizer.param_groups):
            opt.step()
        timeline.poll()
    return int(max(live_curve(timeline.spans, set(), 1.0)))
