"""The training loop: build (meta model -> plan -> shards -> weights), then step.

One step: this rank's micro-batches of the global batch -> for each: forward, loss,
backward (`moetrain.loop.losses.StepLoss` composes the loss: docs/parallelisms.md,
"Loss and gradient scale") -> clip -> update.
The checks before the first step are `moetrain.loop.preflight`; the model is built by
`moetrain.build.model`, the process group by `moetrain.build.distributed`.
The trainer is composed of parts, each built from what it is given:
- `Batches` (moetrain.loop.batches): the data, this rank's micro-batches, the held-out ones;
- `RunState` (moetrain.checkpoint.run_state): what the run holds and saves besides the weights:
  step, samples consumed, guard, sampler position, RNG;
- `RunCheckpoints` (moetrain.checkpoint.run_checkpoints): where the weights come from (init, a resume,
  a new stage), and the saves of the model, the optimizer and that state;
- `StepQueue` (moetrain.loop.step): one optimizer step queued, its record read a step later;
- `PipelinedStep` (moetrain.loop.pipelined): under pipeline stages, the schedule that runs
  the micro-batches instead.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from moetrain.build.distributed import Place, init_distributed, resolve_device
from moetrain.build.float8 import float8_note
from moetrain.build.model import TrainedModel, build_model
from moetrain.build.optimizer import build_optimizer, fused_unsupported
from moetrain.checkpoint.run_checkpoints import RunCheckpoints
from moetrain.checkpoint.run_state import RunState
from moetrain.config import JobConfig
from moetrain.data.batch import Batch
from moetrain.data.prepared import Corpora
from moetrain.loop.balance import attach_bias_update
from moetrain.loop.batches import Batches
from moetrain.loop.guard import StepGuard, likely_cause, loss_weights
from moetrain.loop.losses import BalanceTerms, LossScope, model_inputs
from moetrain.loop.pipelined import build_pipelined, moe_layers, pipeline_evaluation
from moetrain.loop.preference import ModelLogps, step_loss
from moetrain.loop.profiling import StepProfiler
from moetrain.loop.run_report import startup_lines, step_figures
from moetrain.loop.step import (
    Queued,
    StepQueue,
    StepWork,
    Update,
    agree_to_stop,
    on_device_path,
    step_end,
)
from moetrain.loop.stored_reference import reference_for, refuse_missing
from moetrain.metrics.logger import MetricsLogger, peak_flops
from moetrain.metrics.sinks import build_sinks
from moetrain.models import get_model_spec
from moetrain.parallelisms.context_parallel import use_cp_table
from moetrain.parallelisms.dims import ParallelDims
from moetrain.parallelisms.fsdp import gather_once_per_step
from moetrain.parallelisms.mesh import build_meshes
from moetrain.parallelisms.plan import match_modules
from moetrain.parallelisms.trace import named_range


class Trainer:
    """A run: its parts built in order (model, data, state, checkpoints, steps, metrics),
    then the loop (`fit`). It wires the parts; each reads only what it was built with."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, corpora: Corpora | None = None) -> None:
        """`corpora`: the config's prepared directories as `preflight` opened them (None:
        opened here)."""
        self.cfg, self.dims = cfg, dims
        self.spec = get_model_spec(cfg.model.name)
        self.args = cfg.model.args
        self.device = resolve_device(cfg.train.device)
        init_distributed(self.device)
        self.rank = dist.get_rank()
        self.meshes = build_meshes(dims, self.device.type)
        self.place = Place(dims, self.meshes, self.device)
        torch.manual_seed(cfg.train.seed)  # the RNG state a checkpoint saves starts from it
        self.history: list[dict] = []
        self._stop_requested = False
        self.notes: list[str] = []  # said on the console once the logger exists

        self._build_model()
        self.batches = Batches(cfg, self.place, self.terms, corpora)
        t = cfg.train
        guard = StepGuard(t.max_skipped_steps, t.skip_spike_sigma, t.skip_spike_window)
        self.state = RunState(cfg, self.batches.order, guard, self.device, self.rank)
        trained = TrainedModel(self.model, self.optimizer, self.parallel.whole)
        stop_requested = lambda: self._stop_requested  # noqa: E731
        self.checkpoints = RunCheckpoints(
            cfg, self.spec, trained, self.state, corpora, stop_requested
        )
        resume_from, notes = self.checkpoints.begin()
        self.notes += notes
        # DPO's reference of the initial model, before step 1 (dpo.reference=stored, copy)
        ready = (cfg, self.model, self.terms, self.batches, self.state, resume_from)
        self.notes += self.reference.fill(*ready)
        for dispatcher in self.dispatchers:  # a first pass's EP bytes are no step's
            dispatcher.reset_traffic()
        if self.shared_embedding is not None:  # a stage's copy of the embedding, as loaded
            self.shared_embedding.sync()
        stage_loads = self.pipelined.whole_model_load if self.pipelined is not None else None
        work = StepWork(self.forward_backward, self.dispatchers, stage_loads)
        update = Update(
            self.optimizer,
            self.params,
            self.norm_params,
            self.bias_update,
            self.shared_embedding,
        )
        self.steps = StepQueue(cfg, self.state, work, update, self.place)
        self._build_metrics(resume_from)
        self._start_step = self.state.step  # the step of the weights this run started from
        self._pending: Queued | None = None  # a step queued, its record not read yet
        self._last_end = step_end(self.device)  # when the last step's work ended

    # --- phases of __init__ ------------------------------------------------------------
    def _build_model(self) -> None:
        """The model on the meta device -> the plan applied -> local shards allocated (not
        yet initialised); the optimizer, and the loss the model's terms ask for."""
        cfg = self.cfg
        self.model, self.parallel = build_model(cfg, self.spec, self.dims, self.meshes, self.device)
        self.dispatchers = self.parallel.dispatchers
        if cfg.train.fp8 != "none":
            self.notes.append(float8_note(self.model, self.spec.plan, cfg.train.fp8))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # None on a pipeline stage that trains no parameter (LoRA froze all it holds)
        self.optimizer = build_optimizer(self.model, cfg.train)
        unsupported = fused_unsupported(self.params)
        if self.optimizer is not None and cfg.train.optimizer_impl == "fused" and unsupported:
            self.notes.append(
                f"train.optimizer_impl=fused: torch has no fused AdamW for {unsupported}; "
                "running foreach"
            )
        # Routers with a correction bias move it before every update (their counts summed
        # over the ranks that hold the global batch: this pipeline stage's).
        batch_group = self.meshes.batch_group()
        self.bias_update = attach_bias_update(
            self.model,
            self.optimizer,
            cfg.moe.bias_update_rate,
            batch_group,
            self.spec.bias_buffers,
        )
        # SIGTERM's flag is agreed on the CPU: a collective of the accelerator's backend
        # would make the host wait for the step's work (moetrain.loop.step.agree_to_stop).
        gloo = dist.get_backend() == "gloo"
        self._host_group = None if gloo else dist.new_group(backend="gloo")
        self.terms = self.spec.loss_terms(self.args)
        self.loss_weights = loss_weights(self.spec.aux_loss_field, self.terms, cfg.moe)
        self.grad_accum = self.dims.grad_accum(
            cfg.train.global_batch_size, cfg.train.micro_batch_size
        )
        scope = LossScope(
            self.dims,
            self.meshes.world.get_group("cp"),
            cfg.train.global_batch_size,
            self.grad_accum,
            self.device,
            batch_group,
            moe_layers(self.parallel.whole, self.spec.plan) if self.meshes.pp is not None else 0,
        )
        # Under pipeline stages, the held-out loss of a source's micro-batches through them
        # forward only (moetrain.loop.evaluation), which the DPO reference runs too.
        self.forward_only = pipeline_evaluation(
            cfg, self.parallel, self.meshes, self.device, self.terms, self.model
        )
        staged = self.forward_only
        logps = (
            staged.logps
            if staged is not None
            else ModelLogps(self.model, self.terms, cfg.data.document_mask)
        )
        # train.objective=dpo's reference (dpo.reference)
        self.reference = reference_for(cfg, self.spec, self.place, self.terms, logps)
        objective = cfg.train.objective
        self.step_loss = step_loss(
            objective, cfg.dpo, self.terms, BalanceTerms.of(cfg.moe), scope, self.reference
        )
        self._build_pipeline()

    def _build_pipeline(self) -> None:
        """Under pipeline stages (none without): the schedule over this rank's stages and the
        embedding copies a head may read; and which parameters the gradient norm counts:
        each once, not a stage's copy."""
        cfg, parallel, meshes, device = self.cfg, self.parallel, self.meshes, self.device
        terms = self.terms
        self.pipelined, self.shared_embedding = build_pipelined(
            cfg,
            parallel,
            meshes,
            self.dims,
            self.spec.plan,
            self.rank,
            self.step_loss,
            self.grad_accum,
            device,
            terms,
        )
        copies = self.shared_embedding.copies if self.shared_embedding else set()
        self.norm_params = [p for p in self.params if id(p) not in copies]

    def _build_metrics(self, resumed_from: str | None) -> None:
        cfg = self.cfg
        self.logger = MetricsLogger(
            cfg.job.output_dir,
            cfg.train.steps,
            self.rank == 0,
            cfg.metrics.jsonl,
            cfg.metrics.progress,
            resume_step=self.state.step if resumed_from is not None else None,
            sinks=build_sinks(cfg, self.rank == 0),
        )
        if resumed_from is not None:
            self.logger.info(f"resumed from {resumed_from} at step {self.state.step}")
        for note in self.notes + self.logger.notes:
            self.logger.info(note)
        whole = self.parallel.whole or self.model  # a pipeline stage is not the whole model
        self.flops_per_token = self.spec.flops_per_token(whole, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device)
        self.profiler = StepProfiler(
            cfg.profile.steps,
            cfg.job.output_dir,
            self.rank,
            self.device,
            match_modules(self.model, self.spec.plan.blocks, "blocks"),
            self.logger.info,
            cfg.profile.top,
        )

    # --- one step ------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch]) -> dict:
        """Accumulate the gradients of this rank's micro-batches of one global batch.

        Returns the step's global mean token loss, aux and MTP losses (all ranks agree) and
        the tokens routed to each expert ([L, E], this rank, summed over micro-batches).
        """
        self.step_loss.begin(micro_batches)  # global counts: one all-reduce
        if self.pipelined is not None:
            self.pipelined.step(micro_batches)
            return self.step_loss.end()
        once = self.dims.fsdp_gather(self.cfg.parallel.fsdp_gather) == "step"
        for i, mb in enumerate(micro_batches):
            if once:
                gather_once_per_step(self.model, i == len(micro_batches) - 1)
            if mb.cp_table is not None:  # cp_layout=balanced: this micro-batch's chunks
                use_cp_table(self.parallel.ring_attention, mb.cp_table)
            inputs = model_inputs(mb, self.terms, self.cfg.data.document_mask)
            out = self.model(mb.input_ids, mb.position_ids, **inputs)
            self.step_loss(out, mb).backward()
        return self.step_loss.end()

    def next_micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch, on the training device."""
        batches = self.batches.next_micro_batches()
        self.state.consumed_samples += self.cfg.train.global_batch_size
        return batches

    def evaluate(self) -> dict[str, float]:
        """The held-out loss of the current weights (moetrain.loop.evaluation); the training
        state is untouched, and the EP bytes it moved are not the step's."""
        record = self.batches.evaluate(self.model, self.forward_only)
        for dispatcher in self.dispatchers:
            dispatcher.reset_traffic()
        return record

    def _on_sigterm(self, _signum, _frame) -> None:
        self._stop_requested = True  # acted on at the end of the current step

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM: all ranks must stop (and save) at the same step."""
        return agree_to_stop(self._stop_requested, self._host_group)

    def fit(self) -> list[dict]:
        """Train to train.steps; on SIGTERM, finish the step, save, and return early."""
        previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._fit()
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
            self.logger.close()  # flush TensorBoard / W&B

    def _on_skipped(self, record: dict, queued: Queued) -> None:
        reason = record["skipped"]
        self.logger.info(self.state.guard.note(queued.step, reason))
        if self.state.guard.limit_reached:  # the weights are the last good ones: nothing moved
            # NOTE: the device may have queued the next step already; it skips every step
            # past the limit (guard.DeviceGuard), so the state to save is this step's, with
            # the data position after its batch.
            self.state.step, self.state.consumed_samples = queued.step, queued.consumed_samples
            self.checkpoints.save()
            self.checkpoints.wait()
            untouched = queued.step - self.state.guard.consecutive == self._start_step
            cause = likely_cause(record, self.loss_weights, untouched)
            raise self.state.guard.limit_error(queued.step, reason, cause)

    def _finish(self, queued: Queued, evaluate: bool = False) -> None:
        """Read, log and act on a queued step's record (`settle`); `evaluate`: add the
        held-out loss of the current weights, which must be that step's."""
        cfg = self.cfg
        record = self.steps.settle(queued)
        refuse_missing(record, queued.step)  # a stored DPO reference's lookups
        # From the previous step's end to this one's, as the device ran them (not when the
        # host read them: it reads a step once the next is queued).
        elapsed, self._last_end = queued.end.seconds_since(self._last_end), queued.end
        record.update(
            step_figures(
                cfg, elapsed, self.device, self.flops_per_token, self.peak_flops, self.dims
            )
        )
        # exact global counts: every rank has the blend
        record.update(self.batches.blend_tokens(queued.consumed_samples))
        if evaluate:
            record.update(self.evaluate())
        self.history.append(record)
        step = queued.step
        due = step % cfg.metrics.log_interval == 0 or step == cfg.train.steps
        if due or {"expert_load", "skipped", "eval_loss"} & record.keys():
            self.logger.log(record)  # expert load is computed for logging only
        if "skipped" in record:
            self._on_skipped(record, queued)

    def advance(self, micro_batches: list[Batch]) -> bool:
        """Queue one step and do what the loop does around it (the loop's body, also what
        benchmarks/vs_torchtitan.py times): the previous step's record is read once this one
        is queued, unless the host needs this step's state first (its evaluation, its
        checkpoint, the run's end, a stop) or judges on the host (foreach AdamW, where the
        read decides the update). Returns whether SIGTERM stopped the run (saved)."""
        cfg = self.cfg
        queued = self.steps.queue_step(micro_batches)
        if self._pending is not None:
            self._finish(self._pending)
        self._pending = queued
        every, interval = cfg.eval.interval, cfg.checkpoint.interval
        last = self.state.step == cfg.train.steps
        due = last or every and self.state.step % every == 0
        evaluate = self.batches.has_held_out and due
        save = interval and (self.state.step % interval == 0 or last)
        self.checkpoints.poll()
        stop = self._stop_agreed()
        if not on_device_path(self.optimizer) or evaluate or save or last or stop:
            self.drain(evaluate)
        if stop:
            self.logger.info(f"SIGTERM: saving step {self.state.step} and stopping")
            self.checkpoints.save()
            return True
        if save:
            self.checkpoints.save()
        return False

    def drain(self, evaluate: bool = False) -> None:
        """Read and act on the step still queued, if any (`_finish`)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending, evaluate)

    def _fit(self) -> list[dict]:
        cfg = self.cfg
        parallel = self.parallel
        whole = parallel.whole or self.model  # a pipeline stage is not the whole model
        lines = startup_lines(cfg, self.place, whole, self.grad_accum, parallel)
        for line in lines + self.batches.describe():
            self.logger.info(line)
        self._start_step = self.state.step  # the step of the weights this run started from
        stopped = False
        if self.state.step >= cfg.train.steps:
            self.logger.info(
                f"nothing to do: this run already reached train.steps={cfg.train.steps} (step "
                f"{self.state.step}); raise train.steps to train further, or use a new job.output_dir"
            )
        self._last_end = step_end(self.device)
        self._pending = None
        while self.state.step < cfg.train.steps:
            self.profiler.before_step(self.state.step + 1)
            with named_range(f"step {self.state.step + 1}"):
                with named_range("data.wait"):
                    micro_batches = self.next_micro_batches()
                stopped = self.advance(micro_batches)
            self.profiler.after_step(self.state.step)
            if stopped:
                break
        self.checkpoints.wait()
        applied = [r for r in self.history if "skipped" not in r]
        if self.history and not applied and not stopped:  # every rank: the verdicts are global
            last = self.history[-1]
            cause = likely_cause(last, self.loss_weights, untouched=True)
            raise self.state.guard.nothing_applied_error(
                self._start_step + 1, last["step"], last["skipped"], cause
            )
        if applied:  # a skipped step's loss is not the model's: from the applied ones
            first, last = applied[0], applied[-1]
            self.logger.info(
                f"done: loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                f"(step {last['step']})"
            )
        return self.history
