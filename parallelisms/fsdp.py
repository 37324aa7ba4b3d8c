"""FSDP2 wrapping driven by the model's parallel plan (DESIGN §4, §7)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from models.common.plan import ParallelPlan
from parallelisms.plan import match_modules


def mixed_precision_policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    # Gradients are always reduced in fp32: a bf16 reduce-scatter over many ranks loses
    # the exact-sum property the loss scaling (DESIGN §6) relies on.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module, plan: ParallelPlan, dense_mesh: DeviceMesh, param_dtype: torch.dtype
) -> None:
    """Shard every block, then the root (embeddings, final norm, head) over `dense_mesh`.

    With a 2-D mesh (dp_replicate, fsdp) this is HSDP: shard within a replica group,
    all-reduce gradients across replicas.
    """
    policy = mixed_precision_policy(param_dtype)
    if param_dtype != torch.float32:
        # Routers decide discrete top-k choices: keep their weights in fp32 so that bf16
        # rounding does not flip routing decisions between layouts.
        fp32 = mixed_precision_policy(torch.float32)
        for pattern in plan.fp32_modules:
            for _, module in match_modules(model, pattern, "fp32_modules"):
                fully_shard(module, mesh=dense_mesh, mp_policy=fp32)
    for _, block in match_modules(model, plan.blocks, "blocks"):
        fully_shard(block, mesh=dense_mesh, mp_policy=policy)
    # NOTE: the root is not resharded after forward: backward needs it first anyway.
    fully_shard(model, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=False)

    # The loss is already divided by the number of tokens in the global batch, so the
    # gradient reduction must sum, not average (DESIGN §6). Plain SUM collectives (no
    # PreMulSum) also run on gloo, and a factor of 1 makes FSDP skip its division.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
