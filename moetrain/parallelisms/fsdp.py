"""FSDP2 wrapping driven by the model's parallel plan (docs/parallelisms.md, "FSDP2 wrapping and prefetch")."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moetrain.models.common.plan import ParallelPlan
from moetrain.parallelisms.mesh import Meshes
from moetrain.parallelisms.plan import match_modules


def mixed_precision_policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    # Gradients are always reduced in fp32: a bf16 reduce-scatter over many ranks loses
    # the exact-sum property the loss scaling (docs/parallelisms.md, "Loss and gradient scale") relies on.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def _shard_dim1(_param: nn.Parameter) -> Shard:
    return Shard(1)


def apply_fsdp(
    model: nn.Module,
    plan: ParallelPlan,
    meshes: Meshes,
    param_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    required: bool = True,
) -> None:
    """Shard routers (fp32, with bf16), expert-parallel experts, every block, then the root.
    `reshard_after_forward=False` (parallel.fsdp_gather=step) keeps every unit gathered from
    forward into backward; `gather_once_per_step` then holds them across micro-batches.

    Dense parameters shard over `meshes.dense` (HSDP when it is 2-D). Experts already
    sharded on dim 0 by EP get their own units over `meshes.expert_fsdp` on dim 1, so the
    two shardings compose into one DTensor. `required=False`: a pipeline stage, which
    may hold no routed experts.
    """
    policy = mixed_precision_policy(param_dtype)
    if param_dtype != torch.float32:
        # Routers decide discrete top-k choices: keep their weights in fp32 so that bf16
        # rounding does not flip routing decisions between layouts. NOTE: their inputs are
        # not cast here: a router casts its bf16 input itself and keeps it in bf16 for
        # backward (moetrain/models/common/fp32_linear.py), where a cast here would keep an fp32 copy.
        fp32 = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        for _, module in match_modules(model, plan.fp32_modules, "fp32_modules", required=False):
            fully_shard(
                module,
                mesh=meshes.dense,
                mp_policy=fp32,
                reshard_after_forward=reshard_after_forward,
            )
    expert_units: dict[str, nn.Module] = {}
    if meshes.ep is not None:
        found = match_modules(model, plan.routed_experts, "routed_experts", required)
        for fqn, experts in found:
            fully_shard(
                experts,
                mesh=meshes.expert_fsdp,
                shard_placement_fn=_shard_dim1,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
            expert_units[fqn] = experts
    blocks = match_modules(model, plan.blocks, "blocks", required)
    ranks = meshes.dense.shape[-1]  # the fsdp dim (HSDP: the last of two)
    placement = _experts_by_rows(model, plan, ranks) if meshes.ep is None else None
    for _, block in blocks:
        fully_shard(
            block,
            mesh=meshes.dense,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement,
        )
    # NOTE: the root (embeddings, final norm, head) is not resharded after forward:
    # backward needs it first anyway.
    fully_shard(model, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=False)

    # The loss is already divided by the number of tokens in the global batch, so the
    # gradient reduction must sum, not average (docs/parallelisms.md, "Loss and gradient
    # scale"). Plain SUM collectives (no PreMulSum) also run on gloo, and a factor of 1
    # makes FSDP skip its division. NOTE: not on a mesh of one rank, where FSDP copies the
    # gradients out through `grads / factor` whenever a factor is set (a pass over every fp32
    # gradient: benchmarks/results/2026-11-27-vs-torchtitan-h200.json); with no factor,
    # sums alone divide by nothing.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if not _one_rank(module):
                module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if expert_units:
        set_prefetch_chains(model, blocks, expert_units)


def _one_rank(unit: FSDPModule) -> bool:
    """Whether the unit's own parameters (not those of units inside it) are sharded and
    reduced over a mesh of one rank (FSDP made them DTensors on that mesh)."""
    nested = {
        id(p)
        for m in unit.modules()
        if m is not unit and isinstance(m, FSDPModule)
        for p in m.parameters()
    }
    own = [p for p in unit.parameters() if id(p) not in nested]
    return bool(own) and all(p.device_mesh.size() == 1 for p in own)


def _experts_by_rows(model: nn.Module, plan: ParallelPlan, ranks: int):
    """Without EP the routed experts live in their block's unit, which FSDP shards on dim 0,
    the expert dim. With fewer experts than fsdp ranks (Mixtral's 8 over 16), or a count the
    ranks do not divide, some ranks would hold more whole experts than others (or none): their
    memory and gather volume uneven. Such stacks shard on dim 1 (each expert's rows) instead,
    which splits every expert evenly, where the ranks divide it (as EP's expert FSDP asks of
    dim 1). -> FSDP's placement(param) over `ranks`: Shard(1), or None (the default, dim 0)."""
    if plan.routed_experts is None:
        return None
    found = match_modules(model, plan.routed_experts, "routed_experts", required=False)
    stacked = {id(p) for _, experts in found for p in experts.parameters()}

    def placement(param: nn.Parameter) -> Shard | None:
        # FSDP asks for every parameter of the block (norms, biases): only stacks qualify.
        if id(param) not in stacked or param.ndim < 2:
            return None
        return Shard(1) if param.shape[0] % ranks and param.shape[1] % ranks == 0 else None

    return placement


def set_prefetch_chains(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], expert_units: dict[str, nn.Module]
) -> None:
    """Explicit FSDP prefetch (docs/parallelisms.md, "FSDP2 wrapping and prefetch").

    NOTE: why not FSDP's implicit prefetch: the dispatch needs the all-to-all split sizes on
    the host (`.tolist()`), a device sync in the middle of every MoE block. Until it
    returns, the CPU cannot issue the next unit's all-gather, so implicit overlap stops at
    every MoE layer. Explicit lists make each block's pre-forward issue the next block's
    (and its experts') all-gathers before the sync; backward is mirrored.

    The chains are role-stable: a block prefetches the next block and then that block's
    experts, always in this order, so with activation checkpointing the recomputation does
    not keep extra all-gathers alive.
    """

    def units(i: int) -> list[nn.Module]:
        fqn, block = blocks[i]
        return [block] + [m for f, m in expert_units.items() if f.startswith(fqn + ".")]

    model.set_modules_to_forward_prefetch(units(0))  # embeddings (root) -> block 0
    model.set_modules_to_backward_prefetch(units(len(blocks) - 1))  # norm/head -> last block
    for i, (_, block) in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(units(i + 1))
        if i > 0:
            block.set_modules_to_backward_prefetch(units(i - 1))


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters: after forwards with no backward (FSDP2
    reshards the root unit only after backward, so until then its parameters would be the
    gathered tensors, not the sharded ones the optimizer holds)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_once_per_step(model: nn.Module, last_micro_batch: bool) -> None:
    """`parallel.fsdp_gather=step`: call before each micro-batch's forward.

    Parameters gathered by the first forward stay gathered through every later forward and
    backward (units built with `reshard_after_forward=False`, see `apply_fsdp`; resharded
    after backward only at the last micro-batch), and gradients accumulate unsharded in fp32
    (the policy's reduce dtype) until the last backward reduces them once. So a step all-gathers each unit once and reduce-scatters
    once, where `micro_batch` does it per micro-batch (twice for the gathers of resharded
    units); the price is every unit's unsharded parameters and gradients held at once.
    NOTE: the sum over micro-batches then happens before the reduction instead of after
    it: the same gradients up to fp32 rounding order.
    """
    if not isinstance(model, FSDPModule):
        return
    model.set_reshard_after_backward(last_micro_batch, recurse=True)
    model.set_requires_gradient_sync(last_micro_batch, recurse=True)
