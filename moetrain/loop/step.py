"""One optimizer step, queued without reading the device: `queue_step` then `settle`.

Invariant: from a step's first forward op until the next step's forward is queued, the host
reads nothing the device computes, on the default path (fused AdamW). The only reads are
the expert all-to-all's split sizes (drop-less expert parallelism needs them to size its
buffers) and what the pipeline schedules need. So:

- the global token counts normalise the loss on the device (`StepLoss`);
- the guard judges on the device (`guard.DeviceGuard`): its verdict is a bool tensor, and a
  skipped update moves nothing, by fused AdamW's `found_inf` (parameters, moments and step
  count stay) and the bias update's `skip`; the learning rate of the update is read from a
  table on the device at the count of updates applied so far (`lr_table`), since the
  schedule counts applied updates and the host does not know yet which were;
- the step's figures (loss, norm, verdict, counts, expert load) are read by `settle`, which
  the training loop calls for step k once step k + 1 is queued; the host guard then
  `observe`s the device's verdict, and every record is what a synchronous step would log.

With `train.optimizer_impl=foreach` (no `found_inf`), the host reads the verdict before
the update, as it always did. `train_step` (queue then settle at once) serves callers that
want the record of the step they just ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.build.distributed import Place
from moetrain.build.optimizer import lr_factor, set_lr
from moetrain.checkpoint.run_state import RunState
from moetrain.config import JobConfig
from moetrain.data.batch import Batch
from moetrain.loop.balance import BiasUpdate
from moetrain.loop.guard import DeviceGuard, poison_one_gradient, to_device_unblocked
from moetrain.loop.run_report import balance_figures, global_load
from moetrain.parallelisms.clip import clip_grads_, grad_norm
from moetrain.parallelisms.pipeline import SharedEmbedding
from moetrain.parallelisms.trace import named_range


@dataclass
class Queued:
    """A step queued on the device: its record, figures still on the device."""

    step: int
    consumed_samples: int
    record: dict = field(default_factory=dict)
    load: torch.Tensor | None = None  # the global batch's expert load, when due
    end: StepEnd | None = None  # when its work ended (`step_end`)


@dataclass(frozen=True)
class StepEnd:
    """When a step's work ended: on an accelerator, an event recorded on its stream after
    the step's last op (its time is the device's, read once the step's figures are); on the
    CPU, where queueing a step runs it, the host's clock when it was queued."""

    host: float
    event: torch.cuda.Event | None = None

    def seconds_since(self, before: StepEnd) -> float:
        if self.event is not None and before.event is not None:
            return before.event.elapsed_time(self.event) / 1000.0
        return self.host - before.host


def step_end(device: torch.device) -> StepEnd:
    event = None
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return StepEnd(time.perf_counter(), event)


def on_device_path(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether skips are applied on the device: fused AdamW (its `found_inf`), or no
    optimizer at all (a pipeline stage that trains nothing)."""
    return optimizer is None or bool(optimizer.defaults.get("fused"))


@dataclass(frozen=True)
class StepWork:
    """What a step runs before its update: `forward_backward` (a step's micro-batches -> its
    record, gradients accumulated), the expert all-to-alls whose traffic each record counts,
    and under pipeline stages the whole model's expert load (`stage_loads`)."""

    forward_backward: Callable[[list[Batch]], dict]
    dispatchers: list
    stage_loads: Callable[[], torch.Tensor | None] | None = None


@dataclass(frozen=True)
class Update:
    """What an update changes: the optimizer (None on a pipeline stage that trains nothing),
    the trained parameters (clipped), those the gradient norm counts (each once, not a
    stage's copy), the routers' bias update, and the stages' embedding copies (synced after
    an update)."""

    optimizer: torch.optim.Optimizer | None
    params: list[torch.Tensor]
    norm_params: list[torch.Tensor]
    bias_update: BiasUpdate | None = None
    shared_embedding: SharedEmbedding | None = None


class StepQueue:
    """The optimizer steps of a run: each queued on the device (`queue_step`), its record
    read later (`settle`); it advances the run's state by one step each."""

    def __init__(
        self, cfg: JobConfig, state: RunState, work: StepWork, update: Update, place: Place
    ) -> None:
        self.cfg, self.state, self.guard = cfg, state, state.guard
        self.forward_backward, self.dispatchers = work.forward_backward, work.dispatchers
        self.stage_loads = work.stage_loads
        self.optimizer, self.params = update.optimizer, update.params
        self.norm_params, self.bias_update = update.norm_params, update.bias_update
        self.shared_embedding = update.shared_embedding
        self.meshes, self.dims, self.device = place.meshes, place.dims, place.device
        self._first_step_of_run = True  # its expert load is logged whatever the interval
        self.device_guard: DeviceGuard | None = None  # built from `guard` at the first step

    def queue_step(self, micro_batches: list[Batch]) -> Queued:
        """Forward, backward and the (maybe skipped) update of one global batch, queued."""
        self.state.seed_step()
        record = self.forward_backward(micro_batches)
        with named_range("optimizer.step"):
            record.update(self.optimizer_step(record["loss"]))
        queued = Queued(self.state.step, self.state.consumed_samples, record)
        load = record.pop("expert_load")
        interval = self.cfg.metrics.expert_load_interval
        # The first step of a run too: its forward routes with the weights the run began
        # from (the init's routing, "step 0", on a fresh run).
        first, self._first_step_of_run = self._first_step_of_run, False
        due = interval and (first or self.state.step % interval == 0)
        if due and self.stage_loads is not None:  # every stage's layers, in model order
            load = self.stage_loads()
        if load is not None and due:
            queued.load = global_load(load, self.meshes.batch_group())
        if self.dispatchers:  # host counters: the split sizes the dispatch read anyway
            traffic = [d.reset_traffic() for d in self.dispatchers]
            record["a2a_bytes"] = sum(t.sent for t in traffic)
            if 0 < self.meshes.ranks_per_node < self.dims.world_size:  # several nodes
                record["a2a_internode_bytes"] = sum(
                    t.internode + t.internode_routing for t in traffic
                )
        queued.end = step_end(self.device)
        return queued

    def settle(self, queued: Queued) -> dict:
        """The record of a queued step, read from the device (`read_record`); the host guard
        takes the device's verdict."""
        record = read_record(queued.record)
        skipped = bool(record.pop("skip"))
        if "judged" not in record:  # the device judged: the host guard follows its verdict
            verdict = self.guard.observe(record["loss"], record["grad_norm"], skipped)
            record["skipped_steps"] = self.guard.skipped_total
            if verdict.skip:
                record["skipped"] = verdict.reason
        record.pop("judged", None)
        if queued.load is not None:
            record.update(balance_figures(queued.load))
        return record

    def train_step(self, micro_batches: list[Batch]) -> dict:
        """One optimizer step over this rank's micro-batches of the global batch, and its
        record (read at once: a sync, for callers that want the step they just ran)."""
        return self.settle(self.queue_step(micro_batches))

    def optimizer_step(self, loss: torch.Tensor) -> dict:
        """Clip and update, or skip a bad step (`moetrain.loop.guard`); returns the pre-clip
        grad norm, the lr and the verdict (`skip`), as device tensors on the device path."""
        debug = self.cfg.debug
        first = debug.inject_nonfinite_step
        if 0 < first <= self.state.step + 1 < first + debug.inject_nonfinite_count:
            poison_one_gradient(self.params)
        # All-reduced (over the pipeline stages too): every rank holds the global norm.
        stages = self.meshes.pp.get_group() if self.meshes.pp else None
        norm = grad_norm(self.norm_params, stages, self.device)
        if on_device_path(self.optimizer):
            record = self._update_on_device(loss, norm)
        else:
            record = self._update_on_host(float(loss), norm)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return {"step": self.state.step, "grad_norm": norm, **record}

    def _update_on_device(self, loss: torch.Tensor, norm: torch.Tensor) -> dict:
        if self.device_guard is None:  # built from the host guard (a resume loaded it)
            self.device_guard = DeviceGuard(self.guard, self.device)
            table = [
                self.cfg.train.lr * lr_factor(k, self.cfg.train)
                for k in range(self.cfg.train.steps + 1)
            ]
            self.lr_table = to_device_unblocked(torch.tensor(table), self.device)
        guard = self.device_guard
        # The schedule counts applied updates: a skipped step does not advance it.
        applied = (self.state.step - guard.skipped).clamp(0, len(self.lr_table) - 1)
        lr = self.lr_table.index_select(0, applied.view(1)).view(())  # (t[i] would read i)
        skip = guard.judge(loss, norm)
        # Fused AdamW clips in its own kernel (`clip_grads_`: its `grad_scale`).
        clip_grads_(self.params, self.cfg.train.max_grad_norm, norm, self.optimizer)
        if self.bias_update is not None:
            self.bias_update.skip = skip
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.found_inf = skip.float()  # fused AdamW: a skip moves nothing
            self.optimizer.step()
            # NOTE: a float again for what a checkpoint saves of the groups: the schedule is
            # a function of the applied count (never read back), and DCP would otherwise
            # write a tensor where an older checkpoint holds a number.
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.train.lr
        elif self.bias_update is not None:  # no optimizer to run it as its pre-step hook
            self.bias_update()
        if self.shared_embedding is not None:  # unchanged when skipped: the same copy
            self.shared_embedding.sync()
        return {"lr": lr, "skip": skip, "loss": loss}

    def _update_on_host(self, loss: float, norm: torch.Tensor) -> dict:
        """The foreach path: the verdict is read before the update (a host sync)."""
        lr = set_lr(self.optimizer, self.state.step - self.guard.skipped_total, self.cfg.train)
        verdict = self.guard.judge(loss, norm.item())
        if verdict.skip:
            if self.bias_update is not None:
                self.bias_update.discard()
        else:
            clip_grads_(self.params, self.cfg.train.max_grad_norm, norm)
            self.optimizer.step()
            if self.shared_embedding is not None:
                self.shared_embedding.sync()
        record = {"lr": lr, "skip": verdict.skip, "judged": True, "loss": loss}
        record["skipped_steps"] = self.guard.skipped_total
        if verdict.skip:
            record["skipped"] = verdict.reason
        return record


def agree_to_stop(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank asks to stop: a CPU all-reduce over `group` (gloo), which queues
    nothing on the accelerator and so never waits for it."""
    if dist.get_world_size(group) == 1:  # no other rank to ask
        return flag
    tensor = torch.tensor([float(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())


def read_record(record: dict) -> dict:
    """`record` with its one-element device figures read into Python numbers (floats as
    float64, counts as int64: one transfer each). Larger tensors (the expert load) are
    left as they are."""
    out = dict(record)
    scalars = [k for k, v in record.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    for floating in (True, False):
        keys = [k for k in scalars if record[k].is_floating_point() == floating]
        if keys:
            dtype = torch.float64 if floating else torch.int64
            # NOTE: `stack` promotes (fp32 to float64, bool to int64, exactly): one op, where
            # a cast and a reshape of each figure cost a launch each.
            figures = [record[k] if record[k].dim() == 0 else record[k].reshape(()) for k in keys]
            values = torch.stack(figures).to(dtype).tolist()
            out.update(zip(keys, values, strict=True))
    return out
