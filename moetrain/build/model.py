"""A config -> the model: on the meta device, with its adapters and the dtype it computes
in, then sharded by its plan. The one place a model is built from a config: the run, the
planner, the export, evaluation and generation all call these.

- `compute_dtype`: `train.mixed_precision` on a device type (auto: bf16 on CUDA, fp32
  elsewhere). The planner asks it for the device the launch will run on.
- `moe_options`: the MoE layers' options the config sets (`[moe]`, `parallel.ep_overlap`).
- `meta_model`: the model on the meta device, with LoRA adapters when `peft` says so (and,
  for a run, the frozen base held in `peft.base_dtype`).
- `parallelize_options`: what the config asks of `moetrain.parallelisms.parallelize`.
- `TrainedModel`: what a rank trains and saves (its shards, the optimizer, the whole).
- `build_model`: the run's model: meta -> FP8 forms (`train.fp8`, moetrain/build/float8.py)
  -> plan -> this rank's shards allocated (under pipeline stages, this rank's stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetrain.build.float8 import apply_float8
from moetrain.build.lora import apply_lora, hold_frozen_base
from moetrain.config import JobConfig, TrainSection
from moetrain.config.moe_peft import PeftSection
from moetrain.models.common.moe import MoEOptions
from moetrain.models.spec import ModelSpec
from moetrain.parallelisms.dims import ParallelDims
from moetrain.parallelisms.mesh import Meshes
from moetrain.parallelisms.parallelize import Parallelized, parallelize
from moetrain.parallelisms.pipeline import LocalStages
from moetrain.parallelisms.pipeline_build import (
    PipelineCut,
    cut_pipeline,
    example_inputs,
    last_stage_output,
    stage_module,
)
from moetrain.parallelisms.plan import match_modules


@dataclass(frozen=True)
class TrainedModel:
    """What a rank trains and saves: its shards (`model`; under pipeline stages, its
    stages), the optimizer (None on a stage that trains nothing), and the whole model on
    the meta device where `model` is a part of it (else None)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    whole: nn.Module | None = None


def compute_dtype(train: TrainSection, device_type: str) -> torch.dtype:
    """The dtype the blocks compute in: bf16 when `train.mixed_precision` says so, or says
    auto on CUDA; fp32 otherwise (parameters stay fp32 masters either way)."""
    auto_bf16 = train.mixed_precision == "auto" and device_type == "cuda"
    return torch.bfloat16 if train.mixed_precision == "bf16" or auto_bf16 else torch.float32


def moe_options(cfg: JobConfig) -> MoEOptions:
    return MoEOptions(
        gemm=cfg.moe.gemm,
        capacity_factor=cfg.moe.capacity_factor,
        z_loss=cfg.moe.z_loss_coef > 0,
        chunks=2 if cfg.parallel.ep_overlap == "chunks" else 1,
    )


def meta_model(
    spec: ModelSpec,
    args: Any,
    peft: PeftSection | None = None,
    options: MoEOptions | None = None,
    hold_base: bool = False,
) -> nn.Module:
    """The model of `args` on the meta device, with LoRA adapters where `peft` asks for them
    (before any plan: the plan shards adapters like their base; None: the model alone);
    `hold_base`: the frozen base in `peft.base_dtype`, as a run holds it."""
    with torch.device("meta"):
        model = spec.build(args, options or MoEOptions())
        if peft is not None and peft.method == "lora":  # a target the model lacks: refused
            apply_lora(model, spec.plan, peft, spec.name)
            if hold_base:
                hold_frozen_base(model, spec.plan, peft)
    return model


def parallelize_options(cfg: JobConfig, dims: ParallelDims) -> dict[str, Any]:
    """The keyword options of `moetrain.parallelisms.parallelize` the config sets."""
    return dict(
        cp_zigzag=cfg.parallel.cp_layout == "zigzag",
        cp_kernel=cfg.parallel.cp_kernel,
        activation_checkpoint=cfg.train.activation_checkpoint,
        compile=cfg.train.compile,
        fsdp_gather=dims.fsdp_gather(cfg.parallel.fsdp_gather),
        ep_overlap=cfg.parallel.ep_overlap,
    )


def build_model(
    cfg: JobConfig, spec: ModelSpec, dims: ParallelDims, meshes: Meshes, device: torch.device
) -> tuple[nn.Module, Parallelized]:
    """The model on the meta device -> the plan applied -> its local shards allocated on
    `device` (not initialised: weights come from init, a checkpoint or HF), in train mode."""
    model = meta_model(spec, cfg.model.args, cfg.peft, moe_options(cfg), hold_base=True)
    if cfg.train.fp8 != "none":
        # Tensorwise: a micro-batch's tokens are split over the cp ranks, and each
        # activation's one amax is taken over all of them (moetrain/models/common/float8.py).
        tensorwise_cp = cfg.train.fp8 == "tensorwise" and meshes.cp > 1
        group = meshes.world.get_group("cp") if tensorwise_cp else None
        apply_float8(model, spec.plan, cfg.train.fp8, spec.name, group)
    dtype = compute_dtype(cfg.train, device.type)
    options = parallelize_options(cfg, dims)

    def shard(module: nn.Module, stage: bool = False) -> Parallelized:
        out = parallelize(module, spec.plan, meshes, dtype, **options, stage=stage)
        module.to_empty(device=device)
        module.train()
        return out

    if meshes.pp is None:
        return model, shard(model)
    # Pipeline stages: cut the whole (meta) model, keep this rank's stages, shard each.
    cut = pipeline_cut(cfg, spec, model)
    mtp_depth = spec.loss_terms(cfg.model.args).mtp_depth
    local = cut.local(meshes.pp.get_local_rank())
    parallel = Parallelized(
        stage_indices=local,
        num_stages=cut.num_stages,
        embedding_on_last=cut.embedding_on_last,
        stage_blocks=cut.blocks,
        whole=model,
    )
    seq_part = cfg.data.seq_len // meshes.cp
    ids, h, kwargs = example_inputs(model, cfg.train.micro_batch_size, seq_part, dtype)
    for index in parallel.stage_indices:
        stage = stage_module(model, spec.plan, cut, index)
        output = h
        if index == cut.num_stages - 1:  # before sharding: on the meta device
            output = last_stage_output(stage, h, kwargs, dtype, mtp_depth)
        parallel.stage_metas[index] = (ids if index == 0 else h, output)
        parallel.extend(shard(stage, stage=True))
        parallel.stages.append(stage)
    shared = ()  # the first stage's embedding stands for the last stage's copy
    if cut.embedding_on_last:
        found = match_modules(model, spec.plan.embedding, "embedding")
        shared = tuple({fqn.partition(".")[0] for fqn, _ in found})
    return LocalStages(parallel.stages, shared), parallel


def pipeline_cut(cfg: JobConfig, spec: ModelSpec, model: nn.Module) -> PipelineCut:
    """The pipeline cut of the whole (meta) `model` for the config."""
    flops = spec.flops_per_token(model, cfg.data.seq_len)
    mtp_depth = spec.loss_terms(cfg.model.args).mtp_depth
    return cut_pipeline(
        model, spec.plan, cfg.parallel, flops.by_kind["attention"], mtp_depth, flops
    )
