"""Global gradient-norm clipping for parameters spread over several meshes and placements."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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
    """
    groups: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float32))
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard() or pl.is_partial())
            key, local = (g.device_mesh, dims), g.to_local()
        else:
            key, local = (None, ()), g
        device = local.device
        groups[key] = groups[key].to(device) + local.float().pow(2).sum()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, dims), sq in groups.items():
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    if stages is not None:
        dist.all_reduce(total, group=stages)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients whose global L2 norm is `norm` (from `grad_norm`) to at most
    max_norm (0 = leave them)."""
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(scale.to(g.device))
