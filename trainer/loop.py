"""The training loop: build (meta model -> plan -> shards -> weights), then step.

Loss scale (DESIGN §6): every micro-batch contributes sum(token losses) / N, N the number
of valid label tokens in the whole global batch (all ranks, all micro-batches), and FSDP
sums gradients instead of averaging. The gradients are then those of one device running
the whole global batch, for any data-parallel layout and accumulation count.
"""

from __future__ import annotations

import os
import time
from dataclasses import fields

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import get_model_spec
from parallelisms.clip import clip_grad_norm_
from parallelisms.fsdp import apply_fsdp
from parallelisms.init import init_weights_global
from parallelisms.mesh import LayoutError, ParallelDims, build_meshes
from trainer.config import JobConfig
from trainer.data import IGNORE_INDEX, DataError, build_dataloader, build_tokenizer
from trainer.hf_io import load_hf_weights
from trainer.metrics import MetricsLogger, flops_per_token, peak_flops, peak_memory_gib
from trainer.optim import build_optimizer, build_scheduler


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
        if ours != getattr(defaults, f.name) and ours != theirs:
            raise LayoutError(
                f"model.{f.name}={ours!r} disagrees with {cfg.model.init_from_hf}/config.json "
                f"({theirs!r}); remove the key or make them equal"
            )
    cfg.model.args = hf_args


def preflight(cfg: JobConfig, dims: ParallelDims) -> None:
    """Checks that need more than the config alone, before any process group exists."""
    resolve_model_args(cfg)
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
        with torch.device("meta"):
            self.model = spec.model_cls(self.args)
        apply_fsdp(
            self.model, spec.plan, self.meshes.dense, torch.bfloat16 if bf16 else torch.float32
        )
        self.model.to_empty(device=self.device)
        if cfg.model.init_from_hf:
            load_hf_weights(self.model, spec.hf_adapter, self.args, cfg.model.init_from_hf)
        else:
            init_weights_global(self.model, cfg.train.seed)
        self.model.train()

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)

        self.dp_rank = self.meshes.dp_rank()
        self.loader, _ = build_dataloader(cfg.data, cfg.train, self.dp_rank, dims.dp_size)
        self.grad_accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dims.dp_size)
        self.step = 0
        self._data_iter = None
        self.history: list[dict] = []
        self.logger = MetricsLogger(
            cfg.job.output_dir,
            cfg.train.steps,
            self.rank == 0,
            cfg.metrics.jsonl,
            cfg.metrics.progress,
        )
        self.flops_per_token = flops_per_token(self.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)  # over the world: every rank holds a distinct part of the batch
        return t

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        """Accumulate the gradients of this rank's micro-batches of one global batch.

        Returns the step's global mean token loss and mean aux loss (all ranks agree).
        """
        coef = getattr(self.args, "router_aux_loss_coef", 0.0)
        local_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches)
        num_tokens = self._all_reduce(local_tokens.to(self.device, torch.float32))
        micro_batches_global = len(micro_batches) * self.dims.dp_size

        sums = torch.zeros(2, device=self.device)  # [sum of token losses, sum of aux losses]
        has_aux = False
        for mb in micro_batches:
            out = self.model(mb["input_ids"], mb["position_ids"])
            ce_sum = F.cross_entropy(
                out.logits.flatten(0, 1).float(),
                mb["labels"].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            loss = ce_sum / num_tokens
            if out.aux_loss is not None:
                # The aux loss is a per-forward mean: weight each micro-batch equally.
                loss = loss + coef * out.aux_loss / micro_batches_global
                sums[1] += out.aux_loss.detach()
                has_aux = True
            loss.backward()
            sums[0] += ce_sum.detach()

        self._all_reduce(sums)
        return {
            "loss": (sums[0] / num_tokens).item(),
            "aux_loss": (sums[1] / micro_batches_global).item() if has_aux else None,
            "tokens": int(num_tokens.item()),
        }

    def optimizer_step(self) -> dict:
        """Clip, update, advance the schedule; returns the pre-clip grad norm and the lr used."""
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "grad_norm": grad_norm.item(), "lr": lr}

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        """One optimizer step over this rank's micro-batches of the global batch."""
        losses = self.forward_backward(micro_batches)
        return {**self.optimizer_step(), **losses}

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global batch, on the training device."""
        if self._data_iter is None:
            self._data_iter = iter(self.loader)  # one iterator: re-iterating drops prefetch
        return [
            {k: v.to(self.device, non_blocking=True) for k, v in next(self._data_iter).items()}
            for _ in range(self.grad_accum)
        ]

    def fit(self) -> list[dict]:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.model.parameters())
        self.logger.info(
            f"{cfg.model.name}: {n_params / 1e6:.2f}M params | world {self.dims.world_size} "
            f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}) | "
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
            if self.step % cfg.metrics.log_interval == 0 or self.step == cfg.train.steps:
                self.logger.log(record)
        if self.history:
            first, last = self.history[0], self.history[-1]
            self.logger.info(
                f"done: loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                f"(step {last['step']})"
            )
        return self.history
