"""A layout's sharded state, measured on the meta device over the fake process group: the
real plan applied to the meta model (`shard`, `sharded_model`), each FSDP unit's buffers
(`fsdp_units`), and the cache a search shares between the layouts it measures (`Measured`).

Instruments: `moetrain.planner.footprint`. The process group must be the fake one, already
initialised with the launch's world size (the planner's `main` does that).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from moetrain.config.objective_checks import dpo_reference

MODES = ("none", "selective", "full")


def param_dtype(cfg):
    """The dtype the launch computes in: the run's own rule (`moetrain.build.model.
    compute_dtype`) on the device the launch will run on (auto: GPUs, what a plan is for)."""
    from moetrain.build.model import compute_dtype

    return compute_dtype(cfg.train, "cpu" if cfg.train.device == "cpu" else "cuda")


class FsdpUnit(NamedTuple):
    """One FSDP unit's buffers, in bytes, from its padded local shards."""

    gathered: int  # the all-gathered (unsharded) parameters, in the unit's compute dtype
    grads: int  # the unsharded fp32 gradients, the reduce-scatter's input
    resharded: bool  # freed after forward (gathered again in backward); False: the root
    block: int | None  # index of the plan block it belongs to
    copied: int  # the local shard cast into the all-gather input
    weight: float  # how many blocks it stands for (sample_blocks)


def fsdp_units(model, plan, param_dtype, module_weight: dict[int, float]) -> list[FsdpUnit]:
    """Every FSDP unit of the parallelized meta model.

    NOTE: the shard group of a parameter is its mesh dim named `fsdp` or `efsdp`
    (`moetrain.parallelisms.mesh`): the gathered size is the padded local shard times its size."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from moetrain.parallelisms.plan import match_modules

    fp32 = {id(m) for _, m in match_modules(model, plan.fp32_modules, "fp32", required=False)}
    # (a pipeline stage's piece may hold no block: moetrain.planner.pipeline_cost)
    blocks = [m for _, m in match_modules(model, plan.blocks, "blocks", required=False)]
    owner_block = {}
    for i, block in enumerate(blocks):
        for m in block.modules():
            owner_block[id(m)] = i
    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        nested = {
            id(p)
            for m in module.modules()
            if m is not module and isinstance(m, FSDPModule)
            for p in m.parameters()
        }
        dtype = torch.float32 if id(module) in fp32 else param_dtype
        gathered = grads = copied = 0
        for p in module.parameters():
            if id(p) in nested:
                continue
            names = p.device_mesh.mesh_dim_names
            group = p.device_mesh.size(names.index("efsdp" if "efsdp" in names else "fsdp"))
            padded = p._local_tensor.untyped_storage().nbytes() // p.element_size()
            gathered += padded * group * dtype.itemsize
            if p.requires_grad:  # frozen (LoRA's base): no gradient, nothing to reduce
                grads += padded * group * 4  # reduced in fp32 (moetrain.parallelisms.fsdp)
            copied += padded * dtype.itemsize  # the shard, cast into the all-gather input
        weight = module_weight.get(id(module), 1.0)  # a sampled block stands for its twins
        block = owner_block.get(id(module))
        units.append(FsdpUnit(gathered, grads, module is not model, block, copied, weight))
    return units


@dataclass
class Measured:
    """What a search measures once and reuses across the layouts that share it
    (`measure_layout(..., reuse=)`): the sharded state and FSDP units of each `[parallel]`
    section with the same FSDP group (the micro-batch does not change them, nor how the
    group splits into dp_shard x cp), and the trace of each (micro-batch,
    cp, checkpointing mode), which runs the plain model at the rank's local shapes, so the
    other degrees change only the gradient bytes it is priced at (`StepTrace.at_grad_bytes`)."""

    shards: dict = field(default_factory=dict)
    traces: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)  # pipeline stages (moetrain.planner.pipeline_stages)
    orders: dict = field(default_factory=dict)  # (schedule, pp, virtual, micro-batches) -> order
    meshes: dict = field(default_factory=dict)  # repr(dims) -> moetrain.parallelisms.mesh.Meshes
    cuts: dict = field(default_factory=dict)  # pipeline cuts and the meta model they cut
    # sampled meta models, built once and copied for each use (`copy_of`)
    models: dict = field(default_factory=dict)

    def copy_of(self, key: tuple, build):
        """A copy of what `build()` returns (a meta model and what refers into it), built
        once per `key`: a copy of a sampled model costs a tenth of building the whole."""
        import copy

        if key not in self.models:
            self.models[key] = build()
        return copy.deepcopy(self.models[key])

    def meshes_of(self, dims):
        from moetrain.parallelisms.mesh import build_meshes

        key = repr(dims)
        if key not in self.meshes:
            self.meshes[key] = build_meshes(dims, "cpu")
        return self.meshes[key]


def shard_key(cfg, dims) -> list:
    """What a model's (or a stage piece's) shards depend on: the [parallel] degrees.

    NOTE: they depend on dp_shard and cp only through their product, the FSDP group (the
    fsdp mesh dim flattens them in rank order: moetrain.parallelisms.mesh), so layouts that trade
    one for the other share one measurement; and not on the pipeline's schedule or cut
    (its ranks per stage stand for `pp`)."""
    staged = ("pp", "pp_schedule", "pp_virtual_stages", "pp_layers")
    degrees = {k: v for k, v in asdict(cfg.parallel).items() if k not in staged}
    degrees.update(dp_shard=dims.fsdp_size, cp=0, stage_ranks=dims.stage_ranks)
    return sorted(degrees.items())


def shard(cfg, spec, dims, world_size: int, meshes, models: Measured | None = None):
    """(sharded state, FSDP units) of the real plan applied to the meta model (`models`:
    where its sampled meta model is kept between calls)."""

    from moetrain.build.model import meta_model
    from moetrain.parallelisms.parallelize import parallelize
    from moetrain.planner.activation_trace import sample_blocks

    dtype = param_dtype(cfg)

    def build():
        # LoRA: the state and gradients of the adapters alone, the base in peft.base_dtype
        model = meta_model(spec, cfg.model.args, cfg.peft, hold_base=True)
        # NOTE: FSDP2's set-up costs time per parameter and rank (about 20 s for
        # DeepSeek-V3 on 2,048 ranks); blocks of one structure shard alike, so two of
        # each stand for all.
        return model, sample_blocks(model, spec.plan)

    key = ("shard", cfg.model.name, repr(cfg.model.args), repr(cfg.peft))
    model, sampled = models.copy_of(key, build) if models is not None else build()
    parallelize(model, spec.plan, meshes, dtype, cp_zigzag=True)
    state, units = sharded_model(model, spec.plan, cfg.train, dtype, sampled, world_size)
    if cfg.train.objective == "dpo" and dpo_reference(cfg) == "copy":
        # DPO's reference as a second, frozen copy of every shard, resident beside the
        # policy (moetrain/loop/reference_copy.py): no gradient, no optimizer state.
        state.frozen = [f + p for f, p in zip(state.frozen, state.params, strict=True)]
        state.params = [2 * p for p in state.params]
    return state, units


def sharded_model(model, plan, train, param_dtype, sampled, world_size: int):
    """(sharded state, FSDP units) of a parallelized meta `model` (or pipeline stage) whose
    repeated blocks `sample_blocks` thinned to `sampled`: each kept block stands for its
    dropped twins too. `world_size`: the ranks its meshes span."""
    from moetrain.build.optimizer import build_optimizer
    from moetrain.planner.footprint import sharded_state

    module_weight = {
        id(m): (len(blocks) + dropped) / len(blocks)
        for blocks, dropped in sampled
        for b in blocks
        for m in b.modules()
    }
    param_weight = {
        id(p): module_weight[id(b)] for blocks, _ in sampled for b in blocks for p in b.parameters()
    }
    frozen = [p for p in model.parameters() if not p.requires_grad]
    # the kernels the launch's parameters get (auto: the launch this plans runs on GPUs)
    optimizer = build_optimizer(model, train, device="cpu" if train.device == "cpu" else "cuda")
    # train.optimizer_state_dtype=bf16: the moments in 2 bytes, whatever the meta step made
    moments = 2 if train.optimizer_state_dtype == "bf16" else None
    state = sharded_state(optimizer, world_size, param_weight, frozen, moments)
    return state, fsdp_units(model, plan, param_dtype, module_weight)
