"""Apply a model's parallel plan: context and expert parallelism (or, without CP, the
flash-attn-4 attention core when asked), activation checkpointing, then FSDP2
(docs/overview.md, "Principles")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moetrain.models.common.plan import ParallelPlan
from moetrain.parallelisms.activation_checkpoint import apply_activation_checkpointing
from moetrain.parallelisms.compile import apply_compile
from moetrain.parallelisms.context_parallel import ContextParallelAttention, apply_context_parallel
from moetrain.parallelisms.dims import LayoutError, ParallelDims
from moetrain.parallelisms.expert_parallel import TokenDispatcher, apply_expert_parallel
from moetrain.parallelisms.flash_attention import apply_flash_attention
from moetrain.parallelisms.fsdp import apply_fsdp
from moetrain.parallelisms.mesh import Meshes
from moetrain.parallelisms.plan import PlanError, check_plan, match_modules


@dataclass
class Parallelized:
    """What the trainer needs to read back from the applied plan."""

    dispatchers: list[TokenDispatcher] = field(default_factory=list)  # one per MoE layer (EP)
    ring_attention: list[ContextParallelAttention] = field(default_factory=list)  # CP
    # Pipeline parallelism: this rank's stages (moetrain.parallelisms.pipeline.StageModule), their
    # indices, and the whole model on the meta device (what describes the whole: FLOPs).
    stages: list[nn.Module] = field(default_factory=list)
    stage_indices: list[int] = field(default_factory=list)
    num_stages: int = 1
    embedding_on_last: bool = False  # the last stage holds a copy of the embedding
    stage_blocks: list[list[str]] = field(default_factory=list)  # each stage's blocks
    whole: nn.Module | None = None
    # stage index -> (example input, example output) on the meta device
    stage_metas: dict[int, tuple] = field(default_factory=dict)

    def extend(self, other: Parallelized) -> None:
        self.dispatchers += other.dispatchers
        self.ring_attention += other.ring_attention


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    meshes: Meshes,
    param_dtype: torch.dtype,
    cp_zigzag: bool = True,
    cp_kernel: str = "auto",
    activation_checkpoint: str = "none",
    compile: bool = False,
    fsdp_gather: str = "micro_batch",
    ep_overlap: str = "shared",
    stage: bool = False,
) -> Parallelized:
    """Shard `model` (on the meta device) in place: context parallelism swaps the attention
    cores for ring attention (without it, `cp_kernel=flash_attn` swaps them for
    flash-attn-4's core; the other kernels are the ring's only), expert parallelism shards
    and wraps the routed experts, activation checkpointing (none | full | selective) wraps
    the blocks' forwards (compiled first if `compile`), FSDP2 shards the rest
    (`fsdp_gather`: parallel.fsdp_gather; `ep_overlap`: parallel.ep_overlap).
    `stage`: `model` is one pipeline stage (or the planner's piece of one), which may hold
    no expert, attention module or block (the whole model's plan was checked by
    `check_layout`)."""
    out = Parallelized()
    required = not stage
    if meshes.cp > 1:
        cores = match_modules(model, plan.attention_core, "attention_core", required)
        out.ring_attention = apply_context_parallel(
            model, cores, meshes.world, cp_zigzag, cp_kernel
        )
    elif cp_kernel == "flash_attn":  # preflight refused a plan that names no core
        cores = match_modules(model, plan.attention_core or (), "attention_core", required)
        apply_flash_attention(model, cores)
    if meshes.ep is not None:
        nodes = (meshes.ep_rail, meshes.ep_node) if meshes.ep_rail is not None else None
        for layer in expert_layers(model, plan, required):
            out.dispatchers.append(
                apply_expert_parallel(layer, meshes.ep, meshes.ranks_per_node, nodes, ep_overlap)
            )
    # NOTE: before FSDP (as torchtitan does); FSDP's hooks on a block run around its
    # checkpointed forward, not inside the replay.
    blocks = match_modules(model, plan.blocks, "blocks", required)
    if compile:  # NOTE: inside checkpointing, not around it (see moetrain/parallelisms/compile.py)
        apply_compile(blocks)
    apply_activation_checkpointing(blocks, activation_checkpoint)
    apply_fsdp(
        model,
        plan,
        meshes,
        param_dtype,
        # NOTE: a pipeline stage keeps its units gathered from the first micro-batch's
        # forward to the step's end (torch's schedules reduce its gradients once, after the
        # last backward), as torchtitan does under PP: no gather per micro-batch, and the
        # split backward of the zero-bubble schedules finds the unsharded parameters.
        reshard_after_forward=fsdp_gather != "step" and not stage,
        required=required,
    )
    return out


def expert_layers(
    model: nn.Module, plan: ParallelPlan, required: bool = True
) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """Each MoE layer's (Permute, routed experts, Unpermute), paired by the plan's order."""
    experts = match_modules(model, plan.routed_experts, "routed_experts", required)
    layer = [experts]
    for field_name, module in (("routed_permute", "Permute"), ("routed_sum", "Unpermute")):
        matches = match_modules(model, getattr(plan, field_name) or (), field_name, False)
        if len(matches) != len(experts):
            raise PlanError(
                f"parallel plan: {len(experts)} routed_experts modules but {len(matches)} "
                f"{field_name} modules; name each MoE layer's {module} in the model's PLAN "
                f"({field_name})"
            )
        layer.append(matches)
    experts, permutes, sums = layer
    return [(p, e, s) for (_, p), (_, e), (_, s) in zip(permutes, experts, sums, strict=True)]


def check_layout(model: nn.Module, plan: ParallelPlan, dims: ParallelDims) -> None:
    """Refuse a layout this model cannot take, from a meta-device instance (no memory, no
    process group): the plan must describe the model (`check_plan`, on every layout), and
    the expert shards must be even."""
    check_plan(model, plan)
    if dims.cp > 1:
        if plan.attention_core is None:
            raise LayoutError(
                f"parallel.cp={dims.cp}, but this model's plan names no attention core"
            )
        match_modules(model, plan.attention_core, "attention_core")
    if dims.ep == 1:
        return
    if plan.routed_experts is None:
        raise LayoutError(f"parallel.ep={dims.ep}, but this model's plan names no routed experts")
    if not match_modules(model, plan.routed_experts, "routed_experts", required=False):
        # The plan is right (check_plan passed it): the configuration builds no MoE layer.
        raise LayoutError(
            f"parallel.ep={dims.ep} splits the routed experts over ranks, but this "
            f"{type(model).__name__} as configured has none (its [model] keys make every "
            "layer dense); set parallel.ep=1, or configure MoE layers"
        )
    expert_layers(model, plan)
    for fqn, experts in match_modules(model, plan.routed_experts, "routed_experts"):
        for name, param in experts.named_parameters():
            if param.shape[0] % dims.ep:
                raise LayoutError(
                    f"{param.shape[0]} experts ({fqn}.{name}) cannot be split evenly over "
                    f"parallel.ep={dims.ep}; choose an ep that divides the number of experts"
                )
            if param.shape[1] % dims.efsdp_size:
                raise LayoutError(
                    f"dim 1 of {fqn}.{name} ({param.shape[1]}) is not divisible by the expert "
                    f"FSDP degree dp_shard*cp/ep = {dims.efsdp_size}; change parallel.ep or "
                    "parallel.dp_shard"
                )
