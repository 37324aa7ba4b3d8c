"""Global gradient-norm clipping for parameters spread over several meshes and placements."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local_grads(params: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """This rank's gradient tensors, grouped by (mesh, mesh dims they are sharded or
    partial on); plain tensors (no mesh) under (None, ())."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard() or pl.is_partial())
            groups.setdefault((g.device_mesh, dims), []).append(g.to_local())
        else:
            groups.setdefault((None, ()), []).append(g)
    return groups


@torch.no_grad()
def grad_norm(
    params: Iterable[torch.Tensor],
    stages: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """L2 norm of all gradients, equal to the norm of the unsharded gradients. `stages`:
    the pipeline's group, whose ranks hold the other stages' parameters. `device`: where
    the norm lives when no gradient says (a stage that trains no parameter still joins
    the pipeline's all-reduce, whose backend may need the accelerator's tensors).

    Squared sums of local shards are grouped by (mesh, sharded mesh dims), and each group
    is all-reduced once over exactly the dims its tensors are sharded on: replicated dims
    already hold the same values and must not be counted twice.

    NOTE: one `_foreach_norm` per group (per-tensor norms in fp32, read from the gradients
    in their own dtype: no fp32 copy of a bf16 gradient, no squared copy of any), then the
    group's squared sum from those few scalars. Nothing is made on the host and moved:
    every tensor of the step is born on the gradients' device, so the norm needs no host
    sync (a CPU zero moved to the device per parameter once cost one per step).
    """
    squares = []
    groups = _local_grads(params)
    for (mesh, dims), local in groups.items():
        norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
        # A mesh dim of one rank has nothing to add, but its all-reduce would still launch.
        dims = [dim for dim in dims if mesh.size(dim) > 1]
        if len(groups) == 1 and not dims and stages is None:  # the norm at once (one op)
            return torch.linalg.vector_norm(torch.stack(norms))
        sq = torch.stack(norms).square().sum()
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        squares.append(sq)
    if squares:
        total = torch.stack(squares).sum() if len(squares) > 1 else squares[0]
    else:  # nothing to count here; the pipeline's all-reduce still needs this rank's zero
        total = torch.zeros((), dtype=torch.float32, device=device)
    if stages is not None:
        dist.all_reduce(total, group=stages)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Scale gradients whose global L2 norm is `norm` (from `grad_norm`) to at most
    max_norm (0 = leave them): one `_foreach_mul_` per device, by the scale as a tensor
    (never read on the host).

    `optimizer`, when it is a fused AdamW: the gradients are not touched here; it gets the
    scale's inverse as its `grad_scale`, the divisor its kernel applies to each gradient as
    it reads it for the update (and writes back, so the gradients end clipped all the
    same). NOTE: the separate multiply reads and writes every fp32 gradient (6.8 ms a step
    of the H200 proxy); inside the update only the write is added. g / (1 / s) and g * s
    agree to fp32 rounding, and exactly when nothing is clipped (the divisor is then 1).
    The next `optimizer.step()` consumes it.
    """
    if max_norm <= 0:
        return
    if optimizer is not None and optimizer.defaults.get("fused"):
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for local in _local_grads(params).values():
        for g in local:
            by_device.setdefault(g.device, []).append(g)
    for dev, grads in by_device.items():
        # NOTE: the gradients live where the norm was computed; `.to` is then a no-op (a
        # device-to-device copy otherwise, still no host read).
        torch._foreach_mul_(grads, scale.to(dev))
