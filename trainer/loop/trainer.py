"""The training loop: build (meta model -> plan -> shards -> weights), then step.

One step: this rank's micro-batches of the global batch -> for each: forward, loss,
backward (`trainer.loop.losses.StepLoss` composes the loss: docs/architecture.md,
"Loss and gradient scale") -> clip -> update.
The set-up before the first step (checks, device, process group) is `trainer.loop.setup`.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from models import get_model_spec
from models.common.moe import MoEOptions
from parallelisms.clip import clip_grad_norm_
from parallelisms.cp_schedule import split_for_cp
from parallelisms.dims import ParallelDims
from parallelisms.init import init_weights_global
from parallelisms.mesh import build_meshes
from parallelisms.parallelize import parallelize
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import JobConfig, config_to_dict
from trainer.data.batch import Batch
from trainer.data.loader import build_dataloader
from trainer.errors import CheckpointError, DataError
from trainer.hf.weights import load_hf_weights
from trainer.loop.balance import attach_bias_update
from trainer.loop.losses import StepLoss, model_inputs, with_mtp_targets
from trainer.loop.optim import build_optimizer, set_lr
from trainer.loop.setup import init_distributed, resolve_device
from trainer.metrics.logger import MetricsLogger, peak_flops, peak_memory_gib
from trainer.metrics.sinks import build_sinks


class Trainer:
    def __init__(self, cfg: JobConfig, dims: ParallelDims) -> None:
        self.cfg, self.dims = cfg, dims
        self.spec = get_model_spec(cfg.model.name)
        self.args = cfg.model.args
        self.device = resolve_device(cfg.train.device)
        init_distributed(self.device)
        self.rank = dist.get_rank()
        self.meshes = build_meshes(dims, self.device.type)
        torch.manual_seed(cfg.train.seed)  # the RNG state a checkpoint saves starts from it
        self.step = 0
        self.history: list[dict] = []
        self._stop_requested = False
        self._notes: list[str] = []  # said on the console once the logger exists
        if cfg.train.warmup_steps > cfg.train.steps:
            self._notes.append(
                f"train.warmup_steps={cfg.train.warmup_steps} is longer than the run "
                f"(train.steps={cfg.train.steps}): warming up over all {cfg.train.steps} steps"
            )

        self._build_model()
        self._build_data()
        resume_from = self._resume_path()
        if resume_from is None:
            self._init_weights()
        else:  # a resumed run gets every weight (and the data position) from its checkpoint
            self._restore(resume_from)
        self._build_metrics(resume_from)

    # --- phases of __init__ ------------------------------------------------------------
    def _build_model(self) -> None:
        """The model on the meta device -> the plan applied -> local shards allocated (not
        yet initialised); the optimizer, and the loss the model's terms ask for."""
        cfg = self.cfg
        bf16 = cfg.train.mixed_precision == "bf16" or (
            cfg.train.mixed_precision == "auto" and self.device.type == "cuda"
        )
        moe_options = MoEOptions(gemm=cfg.moe.gemm, capacity_factor=cfg.moe.capacity_factor)
        with torch.device("meta"):
            self.model = self.spec.build(self.args, moe_options)
        self.parallel = parallelize(
            self.model,
            self.spec.plan,
            self.meshes,
            torch.bfloat16 if bf16 else torch.float32,
            cp_zigzag=cfg.parallel.cp_layout == "zigzag",
            cp_kernel=cfg.parallel.cp_kernel,
            activation_checkpoint=cfg.train.activation_checkpoint,
            compile=cfg.train.compile,
        )
        self.dispatchers = self.parallel.dispatchers
        self.model.to_empty(device=self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.train)
        # Routers with a correction bias move it before every update (world = global batch).
        self.bias_update = attach_bias_update(self.model, self.optimizer, cfg.moe.bias_update_rate)
        self.terms = self.spec.loss_terms(self.args)
        self.grad_accum = self.dims.grad_accum(
            cfg.train.global_batch_size, cfg.train.micro_batch_size
        )
        self.cp_rank = self.meshes.world.get_local_rank("cp")
        self.step_loss = StepLoss(
            self.terms,
            cfg.moe.aux_loss_mode,
            self.dims,
            self.meshes.world.get_group("cp"),
            cfg.train.global_batch_size,
            self.grad_accum,
            self.device,
        )

    def _build_data(self) -> None:
        self.loader, _ = build_dataloader(
            self.cfg.data, self.cfg.train, self.meshes.dp_rank(), self.dims.dp_size
        )
        self.sampler = self.loader.batch_sampler  # the sample order (trainer.data.sampler)
        self.consumed_samples = 0  # global samples of all completed steps
        self._data_iter = None

    def _resume_path(self) -> str | None:
        """The checkpointer, and the checkpoint to resume from (None: a fresh run)."""
        ck = self.cfg.checkpoint
        self.checkpointer = Checkpointer(
            os.path.join(self.cfg.job.output_dir, "checkpoints"), ck.keep_last, ck.async_save
        )
        resume_from = [self.checkpointer.resolve(ck.resume) if self.rank == 0 else None]
        dist.broadcast_object_list(resume_from, src=0)  # every rank loads the same one
        return resume_from[0]

    def _init_weights(self) -> None:
        if self.cfg.model.init_from_hf:
            load_hf_weights(
                self.model, self.spec.hf_adapter, self.args, self.cfg.model.init_from_hf
            )
        else:
            init_weights_global(self.model, self.cfg.train.seed)

    def _build_metrics(self, resumed_from: str | None) -> None:
        cfg = self.cfg
        self.logger = MetricsLogger(
            cfg.job.output_dir,
            cfg.train.steps,
            self.rank == 0,
            cfg.metrics.jsonl,
            cfg.metrics.progress,
            resume_step=self.step if resumed_from is not None else None,
            sinks=build_sinks(cfg, self.rank == 0),
        )
        if resumed_from is not None:
            self.logger.info(f"resumed from {resumed_from} at step {self.step}")
        for note in self._notes:
            self.logger.info(note)
        self.flops_per_token = self.spec.flops_per_token(self.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device)

    # --- one step ------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch]) -> dict:
        """Accumulate the gradients of this rank's micro-batches of one global batch.

        Returns the step's global mean token loss, aux and MTP losses (all ranks agree) and
        the tokens routed to each expert ([L, E], this rank, summed over micro-batches).
        """
        self.step_loss.begin(micro_batches)  # global counts: one all-reduce
        for mb in micro_batches:
            inputs = model_inputs(mb, self.terms, self.cfg.data.document_mask)
            out = self.model(mb.input_ids, mb.position_ids, **inputs)
            self.step_loss(out, mb).backward()
        return self.step_loss.end()

    def optimizer_step(self) -> dict:
        """Clip, update, advance the schedule; returns the pre-clip grad norm and the lr used."""
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        lr = set_lr(self.optimizer, self.step, self.cfg.train)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "grad_norm": grad_norm.item(), "lr": lr}

    def train_step(self, micro_batches: list[Batch]) -> dict:
        """One optimizer step over this rank's micro-batches of the global batch."""
        record = self.forward_backward(micro_batches)
        record.update(self.optimizer_step())
        load = record.pop("expert_load")
        interval = self.cfg.metrics.expert_load_interval
        if load is not None and interval and self.step % interval == 0:
            load = load.clone()
            dist.all_reduce(load)  # [L, E] over the whole global batch
            record["expert_load"] = load.int().tolist()
            record["expert_load_max_over_mean"] = (load.max(1).values / load.mean(1)).tolist()
        if self.dispatchers:
            record["a2a_bytes"] = sum(d.reset_bytes() for d in self.dispatchers)
        return record

    def next_micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch, on the training device."""
        if self._data_iter is None:
            self._data_iter = iter(self.loader)  # one iterator: re-iterating drops prefetch
        zigzag, cp, cp_rank = self.cfg.parallel.cp_layout == "zigzag", self.dims.cp, self.cp_rank
        batches = []
        for _ in range(self.grad_accum):
            batch = next(self._data_iter).to(self.device)
            if self.terms.mtp_depth:  # before the cp split: depth k reads tokens k ahead
                batch = with_mtp_targets(batch, self.terms.mtp_depth)
            if cp > 1:  # this rank's part of each sequence, true positions kept
                batch = batch.map(lambda t: split_for_cp(t, cp_rank, cp, zigzag))
            batches.append(batch)
        self.consumed_samples += self.cfg.train.global_batch_size
        return batches

    # --- checkpoints ------------------------------------------------------------------
    def trainer_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "step": self.step,
            # The LR schedule is a function of the step: nothing more to save.
            # The data position at this step boundary: the same on every rank and layout.
            "data": self.sampler.state_at(self.consumed_samples),
            "rng": rng,  # rank 0's; training itself draws no random numbers after init
            "config": config_to_dict(self.cfg),
            "data_identity": self._data_identity(),
        }

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.model, self.optimizer, self.step, self.trainer_state())

    def _data_identity(self) -> dict:
        summary = self.loader.dataset.summary
        return {
            "source": summary.source,
            "tokens": summary.tokens,
            "fingerprint": summary.fingerprint,
        }

    def _accept_model(self, path: str, state: dict) -> None:
        """Refuse a checkpoint of another architecture before DCP meets mismatched shapes:
        name the [model] keys that differ from the checkpoint's saved config."""
        saved = state.get("config", {}).get("model", {})
        ours = config_to_dict(self.cfg)["model"]
        ignore = {"init_from_hf", *self.spec.training_fields}
        differ = [
            f"model.{k}: checkpoint {saved[k]!r}, this run {ours[k]!r}"
            for k in ours
            if k in saved and k not in ignore and saved[k] != ours[k]
        ]
        if differ:
            raise CheckpointError(
                f"{path} holds another model than this run's ({'; '.join(differ[:6])}); resume "
                "with the checkpoint's model keys, or start a new job.output_dir"
            )

    def _accept(self, path: str, state: dict) -> bool:
        """Before any weight is read: refuse another model, a position that is not at a step
        boundary, or other data unless allowed. Returns whether the data differs."""
        self._accept_model(path, state)
        if state["data"]["micro_batches_into_step"]:
            # The trainer saves at step boundaries only; a mid-step position would put its
            # own count of consumed samples out of step with the sampler's.
            raise DataError(f"{path}: its data position is not at a step boundary")
        saved, ours = state.get("data_identity"), self._data_identity()
        if not saved or saved["fingerprint"] == ours["fingerprint"]:
            return False
        if not self.cfg.checkpoint.allow_data_change:
            raise DataError(
                f"{path} was trained on other data ({saved['source']}, {saved['tokens']:,} "
                f"tokens) than this run's ({ours['source']}, {ours['tokens']:,} tokens; "
                "content fingerprints differ); resume on its data, or pass "
                "--checkpoint.allow_data_change=true to continue on this data on purpose"
            )
        self._notes.append(f"resuming on other data than {path}'s, as allowed")
        return True

    def _restore(self, path: str) -> None:
        state = self.checkpointer.read(path)
        other_data = self._accept(path, state)
        self.checkpointer.load_weights(path, self.model, self.optimizer)
        self.step = state["step"]
        if other_data:  # on purpose: continue the global sample count in the new data's order
            self.sampler.consumed_samples = int(state["data"]["consumed_samples"])
        else:
            self.sampler.load_state_dict(state["data"])
        self.consumed_samples = self.sampler.consumed_samples
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
            self.logger.close()  # flush TensorBoard / W&B

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
        dataset = self.loader.dataset
        self.logger.info(dataset.summary.describe(cfg.data.seq_len, len(dataset)))
        if self.step >= cfg.train.steps:
            self.logger.info(
                f"nothing to do: this run already reached train.steps={cfg.train.steps} (step "
                f"{self.step}); raise train.steps to train further, or use a new job.output_dir"
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
