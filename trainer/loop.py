"""The training loop: build (meta model -> plan -> shards -> weights), then step.

Loss scale (DESIGN §6): every micro-batch contributes sum(token losses) / N, N the number
of valid label tokens in the whole global batch (all ranks, all micro-batches), and FSDP
sums gradients instead of averaging. The gradients are then those of one device running
the whole global batch, for any data-parallel layout and accumulation count.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from models import get_model_spec
from models.common.moe import MoEOptions
from parallelisms.clip import clip_grad_norm_
from parallelisms.context_parallel import split_for_cp
from parallelisms.init import init_weights_global
from parallelisms.mesh import LayoutError, ParallelDims, build_meshes
from parallelisms.parallelize import check_layout, parallelize
from trainer.balance import attach_bias_update
from trainer.checkpoint import Checkpointer, check_checkpoint
from trainer.config import JobConfig, config_to_dict
from trainer.data import (
    IGNORE_INDEX,
    DataError,
    add_mtp_targets,
    build_dataloader,
    build_tokenizer,
    grad_accum_steps,
)
from trainer.hf_io import load_hf_weights
from trainer.losses import aux_loss_share, token_loss_sum
from trainer.metrics import MetricsLogger, peak_flops, peak_memory_gib
from trainer.optim import build_optimizer, set_lr


def resolve_model_args(cfg: JobConfig) -> None:
    """With model.init_from_hf, the architecture comes from the HF config.json.

    Keys set in the job config to something other than their default must agree with it:
    silently training a different shape than the user wrote would be worse than an error.
    """
    if not cfg.model.init_from_hf:
        return
    spec = get_model_spec(cfg.model.name)
    hf_args = spec.hf_adapter.load_hf_config(cfg.model.init_from_hf)
    defaults = spec.args_cls()
    for f in fields(spec.args_cls):
        ours, theirs = getattr(cfg.model.args, f.name), getattr(hf_args, f.name)
        if f.name in spec.training_fields:
            setattr(hf_args, f.name, ours)  # a training choice: the job config's
            continue
        if ours != getattr(defaults, f.name) and ours != theirs:
            raise LayoutError(
                f"model.{f.name}={ours!r} disagrees with {cfg.model.init_from_hf}/config.json "
                f"({theirs!r}); remove the key or make them equal"
            )
    cfg.model.args = hf_args


def preflight(cfg: JobConfig, dims: ParallelDims) -> None:
    """Checks that need more than the config alone, before any process group exists."""
    resolve_model_args(cfg)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_checkpoint(cfg.checkpoint.resume)
    if (
        dims.cp > 1
        and cfg.parallel.cp_kernel == "cpu_flash"
        and resolve_device(cfg.train.device).type != "cpu"
    ):
        raise LayoutError(
            "parallel.cp_kernel=cpu_flash runs on CPU only, but training runs on CUDA; use "
            "parallel.cp_kernel=auto or math"
        )
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        check_layout(spec.build(cfg.model.args), spec.plan, dims)
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dims.dp_size):
        raise LayoutError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size * data-parallel ranks = {t.micro_batch_size} * "
            f"{dims.dp_size}; change one of them"
        )
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.args.vocab_size:
        raise DataError(
            f"tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {cfg.model.args.vocab_size}; raise model.vocab_size or use a "
            "smaller tokenizer"
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
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # plain `python train.py`: a world of one, so the code path stays the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Trainer:
    def __init__(self, cfg: JobConfig, dims: ParallelDims) -> None:
        self.cfg = cfg
        self.dims = dims
        self.device = resolve_device(cfg.train.device)
        init_distributed(self.device)
        self.rank = dist.get_rank()
        self.meshes = build_meshes(dims, self.device.type)
        torch.manual_seed(cfg.train.seed)

        spec = get_model_spec(cfg.model.name)
        self.args = cfg.model.args
        bf16 = cfg.train.mixed_precision == "bf16" or (
            cfg.train.mixed_precision == "auto" and self.device.type == "cuda"
        )
        moe_options = MoEOptions(gemm=cfg.moe.gemm, capacity_factor=cfg.moe.capacity_factor)
        with torch.device("meta"):
            self.model = spec.build(self.args, moe_options)
        self.parallel = parallelize(
            self.model,
            spec.plan,
            self.meshes,
            torch.bfloat16 if bf16 else torch.float32,
            cp_zigzag=cfg.parallel.cp_layout == "zigzag",
            cp_kernel=cfg.parallel.cp_kernel,
        )
        self.dispatchers = self.parallel.dispatchers
        self.model.to_empty(device=self.device)

        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(
            os.path.join(cfg.job.output_dir, "checkpoints"), ck.keep_last, ck.async_save
        )
        resume_from = [self.checkpointer.resolve(ck.resume) if self.rank == 0 else None]
        dist.broadcast_object_list(resume_from, src=0)  # every rank loads the same one
        if resume_from[0] is None:  # a resumed run gets every weight from its checkpoint
            if cfg.model.init_from_hf:
                load_hf_weights(self.model, spec.hf_adapter, self.args, cfg.model.init_from_hf)
            else:
                init_weights_global(self.model, cfg.train.seed)
        self.model.train()

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.train)
        # Routers with a correction bias move it before every update (world = global batch).
        self.bias_update = attach_bias_update(self.model, self.optimizer, cfg.moe.bias_update_rate)
        self.mtp_depth = getattr(self.args, "num_nextn_predict_layers", 0)

        self.dp_rank = self.meshes.dp_rank()
        self.cp_group = self.meshes.world.get_group("cp")
        self.cp_rank = self.meshes.world.get_local_rank("cp")
        self.loader, _ = build_dataloader(cfg.data, cfg.train, self.dp_rank, dims.dp_size)
        self.grad_accum = grad_accum_steps(
            cfg.train.global_batch_size, cfg.train.micro_batch_size, dims.dp_size
        )
        self.step = 0
        self._data_iter = None
        self.history: list[dict] = []
        self._stop_requested = False
        if resume_from[0] is not None:
            self._restore(resume_from[0])
        self.logger = MetricsLogger(
            cfg.job.output_dir,
            cfg.train.steps,
            self.rank == 0,
            cfg.metrics.jsonl,
            cfg.metrics.progress,
            resume_step=self.step if resume_from[0] is not None else None,
        )
        if resume_from[0] is not None:
            self.logger.info(f"resumed from {resume_from[0]} at step {self.step}")
        self.flops_per_token = spec.flops_per_token(self.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)  # over the world: every rank holds a distinct part of the batch
        return t

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        """Accumulate the gradients of this rank's micro-batches of one global batch.

        Returns the step's global mean token loss and aux loss (all ranks agree) and the
        tokens routed to each expert ([L, E], this rank, summed over micro-batches).
        """
        coef = getattr(self.args, "router_aux_loss_coef", 0.0)
        # One int64 all-reduce (fp32 counts are exact only to 2^24) of [valid label tokens,
        # an order-independent checksum of the batch's tokens]: the checksum is equal between
        # runs that train on the same samples at this step, whatever the layout.
        # MTP depth k has its own valid-label count (the last k positions of each sequence
        # have no target), all-reduced in the same call.
        counts = sum(
            torch.stack(
                [
                    (mb["labels"] != IGNORE_INDEX).sum(),
                    (mb["input_ids"] * (mb["position_ids"] + 1)).sum(),
                    *((mb["mtp_labels"] != IGNORE_INDEX).sum((0, 1)) if self.mtp_depth else []),
                ]
            )
            for mb in micro_batches
        )
        num_tokens, fingerprint, *mtp_tokens = self._all_reduce(
            counts.to(self.device, torch.int64)
        ).tolist()
        mtp_tokens = [max(n, 1) for n in mtp_tokens]  # sequences shorter than a depth: no NaN
        rounds = len(micro_batches)
        mtp_weight = getattr(self.args, "mtp_loss_weight", 0.0) / max(self.mtp_depth, 1)

        # [sum of token losses, sum of aux values, sum over depths of mean MTP token losses]
        sums = torch.zeros(3, device=self.device)
        expert_load = None
        for mb in micro_batches:
            out = self.model(mb["input_ids"], mb["position_ids"], **self._mtp_inputs(mb))
            ce_sum = token_loss_sum(out.logits, mb["labels"])
            loss = ce_sum / num_tokens
            for k, logits_k in enumerate(out.mtp_logits or []):
                mtp_mean = token_loss_sum(logits_k, mb["mtp_labels"][..., k]) / mtp_tokens[k]
                loss = loss + mtp_weight * mtp_mean
                sums[2] += mtp_mean.detach()
            if out.router_stats is not None:
                aux_share = aux_loss_share(
                    out.router_stats,
                    self.cfg.moe.aux_loss_mode,
                    self.dims,
                    self.cp_group,
                    self.cfg.train.global_batch_size,
                    rounds,
                )
                loss = loss + coef * aux_share
                sums[1] += aux_share.detach()
                load = out.router_stats.tokens_per_expert.sum(1)  # [L, E]
                expert_load = load if expert_load is None else expert_load + load
            loss.backward()
            sums[0] += ce_sum.detach()

        loss_sum, aux, mtp_sum = self._all_reduce(sums).tolist()
        record = {
            "loss": loss_sum / num_tokens,
            "aux_loss": aux if expert_load is not None else None,
            "tokens": num_tokens,
            "data_fingerprint": fingerprint,
            "expert_load": expert_load,
        }
        if self.mtp_depth:
            record["mtp_loss"] = mtp_sum / self.mtp_depth  # mean over depths
        return record

    def _mtp_inputs(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"mtp_input_ids": mb["mtp_input_ids"]} if self.mtp_depth else {}

    def optimizer_step(self) -> dict:
        """Clip, update, advance the schedule; returns the pre-clip grad norm and the lr used."""
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        lr = set_lr(self.optimizer, self.step, self.cfg.train)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "grad_norm": grad_norm.item(), "lr": lr}

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        """One optimizer step over this rank's micro-batches of the global batch."""
        record = self.forward_backward(micro_batches)
        record.update(self.optimizer_step())
        load = record.pop("expert_load")
        interval = self.cfg.metrics.expert_load_interval
        if load is not None and interval and self.step % interval == 0:
            load = self._all_reduce(load.clone())  # [L, E] over the whole global batch
            record["expert_load"] = load.int().tolist()
            record["expert_load_max_over_mean"] = (load.max(1).values / load.mean(1)).tolist()
        if self.dispatchers:
            record["a2a_bytes"] = sum(d.reset_bytes() for d in self.dispatchers)
        return record

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global batch, on the training device."""
        if self._data_iter is None:
            self._data_iter = iter(self.loader)  # one iterator: re-iterating drops prefetch
        batches = []
        for _ in range(self.grad_accum):
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in next(self._data_iter).items()
            }
            if self.mtp_depth:  # before the cp split: depth k reads tokens k ahead
                batch = add_mtp_targets(batch, self.mtp_depth)
            if self.dims.cp > 1:  # this rank's part of each sequence, true positions kept
                zigzag = self.cfg.parallel.cp_layout == "zigzag"
                batch = {
                    k: split_for_cp(v, self.cp_rank, self.dims.cp, zigzag) for k, v in batch.items()
                }
            batches.append(batch)
        return batches

    # --- checkpoints ------------------------------------------------------------------
    def _data_state(self) -> dict:
        """The sampler's position as of the last batch handed out (workers prefetch ahead,
        so the sampler object itself may be further); layout-independent at a step end."""
        state = self.loader.state_dict()
        if "_snapshot" in state:
            state = state["_snapshot"]["_main_snapshot"]
        return state["_index_sampler_state"]

    def trainer_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "step": self.step,
            # The LR schedule is a function of the step: nothing more to save.
            "data": self._data_state(),
            "rng": rng,  # rank 0's; training itself draws no random numbers after init
            "config": config_to_dict(self.cfg),
        }

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.model, self.optimizer, self.step, self.trainer_state())

    def _restore(self, path: str) -> None:
        state = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = state["step"]
        self.loader.batch_sampler.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def _on_sigterm(self, _signum, _frame) -> None:
        self._stop_requested = True  # acted on at the end of the current step

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM: all ranks must stop (and save) at the same step."""
        flag = torch.tensor([float(self._stop_requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def fit(self) -> list[dict]:
        """Train to train.steps; on SIGTERM, finish the step, save, and return early."""
        previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._fit()
        finally:
            signal.signal(signal.SIGTERM, previous_handler)

    def _fit(self) -> list[dict]:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.model.parameters())
        self.logger.info(
            f"{cfg.model.name}: {n_params / 1e6:.2f}M params | world {self.dims.world_size} "
            f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}, "
            f"cp {self.dims.cp}, ep {self.dims.ep}) | "
            f"global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens, "
            f"micro {cfg.train.micro_batch_size}, grad accum {self.grad_accum} | {self.device}"
        )
        while self.step < cfg.train.steps:
            start = time.perf_counter()
            record = self.train_step(self.next_micro_batches())
            elapsed = time.perf_counter() - start
            tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / elapsed
            record.update(
                tokens_per_s=tokens_per_s,
                step_time_s=elapsed,
                peak_mem_gib=peak_memory_gib(self.device),
                mfu=(
                    tokens_per_s * self.flops_per_token / (self.peak_flops * self.dims.world_size)
                    if self.peak_flops
                    else None
                ),
            )
            self.history.append(record)
            due = self.step % cfg.metrics.log_interval == 0 or self.step == cfg.train.steps
            if due or "expert_load" in record:  # expert load is computed for logging only
                self.logger.log(record)
            self.checkpointer.poll()
            if self._stop_agreed():
                self.logger.info(f"SIGTERM: saving step {self.step} and stopping")
                self.save_checkpoint()
                break
            interval = cfg.checkpoint.interval
            if interval and (self.step % interval == 0 or self.step == cfg.train.steps):
                self.save_checkpoint()
        self.checkpointer.wait()
        if self.history:
            first, last = self.history[0], self.history[-1]
            self.logger.info(
                f"done: loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                f"(step {last['step']})"
            )
        return self.history
