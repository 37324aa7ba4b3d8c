"""Before the first step: the checks that need more than the config, the device and the
process group. `train.py` runs `preflight` before any process group exists, so a bad run
is refused with one message and exit code 2 instead of a traceback on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from models import get_model_spec
from models.common.args import field_problems
from models.common.moe import MoEOptions
from models.spec import ModelSpec
from parallelisms.attention_kernels import CUDA_ONLY
from parallelisms.dims import LayoutError, ParallelDims, check_pipeline
from parallelisms.mesh import Meshes
from parallelisms.parallelize import Parallelized, check_layout, parallelize
from parallelisms.pipeline import LocalStages
from parallelisms.pipeline_build import (
    PipelineCut,
    cut_pipeline,
    example_inputs,
    last_stage_output,
    stage_module,
)
from parallelisms.plan import match_modules
from trainer.checkpoint.markers import check_checkpoint
from trainer.config import ConfigError, JobConfig, validate
from trainer.data.corpus import check_corpus, resolve_document_flags
from trainer.data.prepared import Corpora
from trainer.data.run_data import check_held_out
from trainer.data.tokenizers import build_tokenizer
from trainer.errors import DataError
from trainer.loop.peft import apply_lora, hold_frozen_base
from trainer.loop.resume import check_resume, resume_candidate
from trainer.loop.stages import check_stage, check_stage_keys, resolve_stage
from trainer.loop.tokenizer_record import tokenizer_record
from trainer.metrics.sinks import check_sinks


def check_cp_kernel(kernel: str, device_type: str, cfg) -> None:
    """The ring's block kernel against the device and precision training runs in."""
    if kernel == "cpu_flash" and device_type != "cpu":
        raise LayoutError(
            "parallel.cp_kernel=cpu_flash runs on CPU only, but training runs on "
            f"{device_type}; use parallel.cp_kernel=auto or math"
        )
    if kernel in CUDA_ONLY and device_type != "cuda":
        raise LayoutError(
            f"parallel.cp_kernel={kernel} runs on CUDA only, but training runs on "
            f"{device_type}; use parallel.cp_kernel=auto or math"
        )
    if kernel in ("sdpa_flash", "sdpa_cudnn") and cfg.train.mixed_precision == "fp32":
        raise LayoutError(
            f"parallel.cp_kernel={kernel} computes in bf16 only, but "
            f"train.mixed_precision={cfg.train.mixed_precision}; set "
            "train.mixed_precision=bf16, or use parallel.cp_kernel=auto, sdpa_efficient or flex"
        )


def resolve_model_args(cfg: JobConfig) -> None:
    """With model.init_from_hf, the architecture comes from the HF config.json.

    Keys set in the job config to something other than their default must agree with it:
    silently training a different shape than the user wrote would be worse than an error.
    The model's `training_fields` are training choices: always the job config's.
    """
    if not cfg.model.init_from_hf:
        return
    spec = get_model_spec(cfg.model.name)
    if spec.hf_adapter is None:
        raise ConfigError(
            f"model.init_from_hf is set, but model {cfg.model.name!r} has no Hugging Face "
            "adapter; remove the key"
        )
    hf_args = spec.hf_adapter.load_hf_config(cfg.model.init_from_hf)
    defaults = spec.args_cls()
    for f in fields(spec.args_cls):
        ours, theirs = getattr(cfg.model.args, f.name), getattr(hf_args, f.name)
        if f.name in spec.training_fields:
            setattr(hf_args, f.name, ours)
            continue
        if ours != getattr(defaults, f.name) and ours != theirs:
            raise LayoutError(
                f"model.{f.name}={ours!r} disagrees with {cfg.model.init_from_hf}/config.json "
                f"({theirs!r}); remove the key or make them equal"
            )
    # The HF values never went through the config's checks: a config.json the model cannot
    # take is refused here, not inside the model's constructor.
    problems = field_problems(hf_args, "model")
    if not problems and hasattr(hf_args, "validate"):
        problems = hf_args.validate()
    if problems:
        where = f"{cfg.model.init_from_hf}/config.json"
        raise ConfigError(f"{where} gives values this model cannot take: " + "; ".join(problems))
    cfg.model.args = hf_args


def preflight(cfg: JobConfig, dims: ParallelDims) -> Corpora:
    """Checks that need more than the config alone, before any process group exists.
    Returns the config's prepared corpora, each manifest read once, for the run's data."""
    check_sinks(cfg)
    resolve_model_args(cfg)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_checkpoint(cfg.checkpoint.resume)
    check_stage_keys(cfg)
    resume_from = resume_candidate(cfg)
    # A stage starts from checkpoint.init_from only while its job has no checkpoint of its
    # own: a relaunch resumes the stage, even once the checkpoint it started from is gone.
    stage = resolve_stage(cfg) if resume_from is None else None
    if dims.cp > 1:
        check_cp_kernel(cfg.parallel.cp_kernel, resolve_device(cfg.train.device).type, cfg)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
        if cfg.peft.method == "lora":  # a target the model lacks is refused here
            apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
        check_layout(model, spec.plan, dims)
    if dims.pp > 1:
        pipeline_cut(cfg, spec, model)  # refuses a bad cut
        check_pipeline(
            dims.pp,
            cfg.parallel.pp_schedule,
            cfg.parallel.pp_virtual_stages,
            dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size),
            cfg.train.global_batch_size,
        )
    if resume_from is not None:
        check_resume(resume_from, cfg, spec)
    if stage is not None:
        check_stage(stage, cfg, model)
    dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    tokenizer = build_tokenizer(cfg.data)
    vocab = cfg.model.args.vocab_size  # part of the contract (models/spec.py)
    if tokenizer.vocab_size > vocab:
        raise DataError(
            f"tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {vocab}; raise model.vocab_size or use a smaller tokenizer"
        )
    limit = spec.max_positions(cfg.model.args) if spec.max_positions else None
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is longer than the {limit} positions model "
            f"{cfg.model.name!r} is meant for (its [model] position limit); lower data.seq_len "
            "or raise the limit if the model really extends to it"
        )
    corpora = Corpora(cfg.data, cfg.eval)
    check_corpus(cfg.data, tokenizer, corpora)
    check_held_out(cfg.data, cfg.eval, tokenizer, corpora)
    # A chat template changed since the data was rendered is refused here, on every rank:
    # the checkpoints record it for the export (trainer.loop.tokenizer_record).
    tokenizer_record(cfg, corpora)
    resolve_document_flags(cfg.data, corpora)
    validate(cfg)  # again: the rules that read the flags just resolved
    return corpora


def build_model(
    cfg: JobConfig, spec: ModelSpec, dims: ParallelDims, meshes: Meshes, device: torch.device
) -> tuple[nn.Module, Parallelized]:
    """The model on the meta device -> the plan applied -> its local shards allocated on
    `device` (not initialised: weights come from init, a checkpoint or HF), in train mode."""
    bf16 = cfg.train.mixed_precision == "bf16" or (
        cfg.train.mixed_precision == "auto" and device.type == "cuda"
    )
    moe_options = MoEOptions(
        gemm=cfg.moe.gemm,
        capacity_factor=cfg.moe.capacity_factor,
        z_loss=cfg.moe.z_loss_coef > 0,
        chunks=2 if cfg.parallel.ep_overlap == "chunks" else 1,
    )
    with torch.device("meta"):
        model = spec.build(cfg.model.args, moe_options)
        if cfg.peft.method == "lora":  # before the plan: it shards adapters like their base
            apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
            hold_frozen_base(model, spec.plan, cfg.peft)
    dtype = torch.bfloat16 if bf16 else torch.float32

    def shard(module: nn.Module, stage: bool = False) -> Parallelized:
        out = parallelize(
            module,
            spec.plan,
            meshes,
            dtype,
            cp_zigzag=cfg.parallel.cp_layout == "zigzag",
            cp_kernel=cfg.parallel.cp_kernel,
            activation_checkpoint=cfg.train.activation_checkpoint,
            compile=cfg.train.compile,
            fsdp_gather=dims.fsdp_gather(cfg.parallel.fsdp_gather),
            ep_overlap=cfg.parallel.ep_overlap,
            stage=stage,
        )
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


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LayoutError("train.device=cuda but no CUDA device is visible; use cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's shared store
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = round_store(rank, world_size, ROUND_STORE_TIMEOUT)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, device_id=device_id
        )
    elif "RANK" in os.environ:  # launched by torchrun without a shared store, or by the tests
        dist.init_process_group(backend, device_id=device_id)
    else:  # plain `python train.py`: a world of one, so the code path stays the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# How long ranks wait for rank 0 to announce the round's store (torch's default for gloo).
ROUND_STORE_TIMEOUT = timedelta(minutes=30)
# Where rank 0 announces it, in torchrun's shared store.
ROUND_STORE_KEY = "moetrain/round_store"
# One try at an announced store: a live one answers in milliseconds.
_PROBE = timedelta(seconds=1)


def round_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A store of this round's own, hosted by rank 0, found through torchrun's shared store.

    NOTE: torchrun's agent hosts one TCPStore (MASTER_ADDR:MASTER_PORT) that outlives its
    workers and is handed, unprefixed, to every round of them. The process group writes the
    same keys in every round, so after an in-place restart (`--max-restarts`, or a node
    joining) a new rank could read a dead rank's gloo address (or NCCL id) from the round
    before: it connected to a closed port, or both ranks waited for each other, inside the
    new group's first connection (pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT is no
    round id: each agent counts only its own failures, so nodes disagree after one failed.
    So rank 0 starts a fresh store each round and announces it with a random token. An
    announcement left by a dead round names a server that died with its rank 0 (refused)
    or, should the port have been reused, one without that token: the other ranks retry
    until they reach this round's.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        store.set("token", token)
        # NOTE: rank 0's own host, not MASTER_ADDR: with c10d rendezvous the agent's store
        # may live on another node than global rank 0.
        where = {"host": socket.getfqdn(), "port": store.port, "token": token}
        agent.set(ROUND_STORE_KEY, json.dumps(where))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        announced = json.loads(agent.get(ROUND_STORE_KEY))  # waits for the first round's
        try:
            store = dist.TCPStore(announced["host"], announced["port"], world_size, timeout=_PROBE)
            if store.get("token").decode() == announced["token"]:
                store.set_timeout(timeout)
                return store
        except dist.DistError:  # a dead round's server: gone, or not answering in time
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: rank 0 did not announce this round's store within {timeout}"
            )
        time.sleep(0.05)
