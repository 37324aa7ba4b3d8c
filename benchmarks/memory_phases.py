"""Where a training step's memory goes, phase by phase, against the dry-run planner.

    python benchmarks/memory_phases.py --config FILE.toml [--section.key=value ...]
        [--modes=none,selective,full] [--steps=3] [--device=cuda|cpu] [--per-block]
        [--json FILE]

For each `train.activation_checkpoint` mode, a fresh process of one rank builds the run
exactly as train.py does (`Trainer`: meta model, plan, shards, weights, optimizer) and runs
`--steps` real training steps (`StepQueue.train_step`, unchanged). Hooks on the way read
the CUDA caching allocator at every phase boundary: `allocated` when the phase ends,
`peak` = torch.cuda.max_memory_allocated since the phase began (the counter is reset at
each boundary). The phases of a step: begin (data, global counts), forward, loss, backward
(per micro-batch), end (the step's loss all-reduce), grad_norm, lr_and_guard, clip,
optimizer_step, zero_grad, metrics. `--per-block` adds the allocated bytes after each
block's forward. Hooks: a forward pre-hook on the model, wrappers of `StepLoss` and of the
trainer's `grad_norm` / `clip_grads_` names, the optimizer's step hooks and `zero_grad`.

The planner (`moetrain.planner.layout_cost`) measures the same config in this process
(fake process group of 1, meta device); the result puts its figures next to the measured
ones, per mode: the resting state, the forward/backward peak (steps after the first,
which hold the optimizer state), the update peak (norm, clip, optimizer step) and the
run's peak, with measured / planned. On CPU (`--device=cpu`, e.g. with
configs/debug_qwen3_moe.toml) every memory figure is null: a check of the code path.

Prints one JSON object (or writes --json FILE), a table of the figures, then a one-line
summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_result  # noqa: E402

MODES = ("none", "selective", "full")
GIB = 2**30
FORWARD_BACKWARD = ("begin", "forward", "loss", "backward")
UPDATE = ("grad_norm", "lr_and_guard", "clip", "optimizer_step")


def pop_flag(argv: list[str], name: str, default: str | None, switch: bool = False):
    """Take `--name=value` or `--name value` (a flag of this script, not a config key) out
    of argv; a `switch` is just `--name` (then "true")."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            del argv[i]
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            del argv[i]
            return "true" if switch else argv.pop(i)
    return default


# --- one mode, in a process of its own ----------------------------------------------------


class Recorder:
    """Phase boundaries: `mark(name)` closes the phase `name` (allocated now, the peak
    since the last mark) and opens the next. None on a device without the counters."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.events: list[dict] = []
        self.blocks: list[list] = []
        # a step is open from its first forward to zero_grad, a forward until its loss
        self.opened = {"step": False, "forward": False}

    def allocated(self) -> int | None:
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def mark(self, name: str) -> None:
        event = {"phase": name, "allocated": self.allocated(), "peak": None}
        if self.cuda:  # reserved: what the allocator holds from CUDA, fragmentation included
            event["peak"] = self.torch.cuda.max_memory_allocated()
            event["reserved_peak"] = self.torch.cuda.max_memory_reserved()
            self.torch.cuda.reset_peak_memory_stats()
        self.events.append(event)


class _MarkedLoss:
    """`Trainer.step_loss` with marks: the forward ends when the loss is called, the loss
    when it returns, the last backward when the step's `end` is called."""

    def __init__(self, inner, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec

    def __call__(self, out, batch):
        self.rec.opened["forward"] = False
        self.rec.mark("forward")
        loss = self.inner(out, batch)
        self.rec.mark("loss")
        return loss

    def end(self):
        self.rec.mark("backward")
        return self.inner.end()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def instrument(trainer, rec: Recorder, per_block: bool) -> None:
    """Hooks at every phase boundary of `StepQueue.train_step` (see the module doc)."""
    import moetrain.loop.step as loop
    from moetrain.parallelisms.plan import match_modules

    opened = rec.opened

    def before_forward(_module, _args):  # the step's first closes `begin`, a later one a
        rec.mark("backward" if opened["step"] else "begin")  # micro-batch's backward
        opened["step"] = opened["forward"] = True

    # prepend: before FSDP's own pre-forward, so the root's all-gather is the forward's
    trainer.model.register_forward_pre_hook(before_forward, prepend=True)
    trainer.step_loss = _MarkedLoss(trainer.step_loss, rec)
    norm, clip = loop.grad_norm, loop.clip_grads_

    def grad_norm(*args):
        rec.mark("end")
        result = norm(*args)
        rec.mark("grad_norm")
        return result

    def clip_grads_(*args):
        rec.mark("lr_and_guard")
        clip(*args)
        rec.mark("clip")

    loop.grad_norm, loop.clip_grads_ = grad_norm, clip_grads_
    opt = trainer.optimizer
    opt.register_step_post_hook(lambda *_: rec.mark("optimizer_step"))  # (clip opened it)
    zero_grad = opt.zero_grad

    def marked_zero_grad(*args, **kwargs):
        zero_grad(*args, **kwargs)
        rec.mark("zero_grad")
        opened["step"] = False

    opt.zero_grad = marked_zero_grad
    if per_block:  # [forward or replay (a checkpointed block's, in backward), allocated]
        phase = lambda: "forward" if opened["forward"] else "replay"  # noqa: E731
        for _, block in match_modules(trainer.model, trainer.spec.plan.blocks, "blocks"):
            block.register_forward_hook(lambda *_: rec.blocks.append([phase(), rec.allocated()]))


def state_bytes(trainer) -> dict:
    """Bytes behind the parameters and the optimizer state (distinct storages)."""
    import torch

    from moetrain.planner.meta_trace import storage_bytes

    state = [v for s in trainer.optimizer.state.values() for v in s.values()]
    tensors = [v for v in state if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(trainer.params), "optimizer": storage_bytes(tensors)}


def measure_mode(argv: list[str], mode: str, steps: int, per_block: bool) -> dict:
    import torch

    from moetrain.config import load_config
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer
    from moetrain.parallelisms.dims import ParallelDims

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            [*argv, f"--train.activation_checkpoint={mode}", f"--job.output_dir={tmp}",
             "--metrics.jsonl=false", "--metrics.progress=false", "--checkpoint.interval=0",
             f"--train.steps={steps}"]
        )  # fmt: skip
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, steps)
        dims = ParallelDims.of(cfg.parallel, 1)
        corpora = preflight(cfg, dims)
        trainer = Trainer(cfg, dims, corpora)
        rec = Recorder(trainer.device)
        rec.mark("build")  # the run's peak so far: model, weights, data (step 1's events)
        instrument(trainer, rec, per_block)
        per_step = []
        for _ in range(steps):
            batches = trainer.next_micro_batches()
            rec.mark("data")
            start = time.perf_counter()
            record = trainer.steps.train_step(batches)
            rec.mark("metrics")
            per_step.append(
                {"loss": record["loss"], "seconds": time.perf_counter() - start,
                 "events": list(rec.events), "after_block_forward": list(rec.blocks)}
            )  # fmt: skip
            rec.events.clear()
            rec.blocks.clear()
        out = {"mode": mode, "device": str(trainer.device), "steps": per_step}
        out.update(state_bytes(trainer))
        if trainer.device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name()
            out["torch"] = torch.__version__
            out["alloc_retries"] = torch.cuda.memory_stats()["num_alloc_retries"]
        return out


def summarise(child: dict) -> dict:
    """Per phase, the highest peak of the first step and of the later ones; the run's
    peak; what is allocated after the first update (params, state, workspaces)."""

    def highest(steps, phases):
        peaks = [e["peak"] for s in steps for e in s["events"] if e["phase"] in phases]
        return max(peaks) if peaks and None not in peaks else None

    steps = child["steps"]
    later = steps[1:] or steps
    phases = sorted({e["phase"] for s in steps for e in s["events"]})
    first_zero = [e for e in steps[0]["events"] if e["phase"] == "zero_grad"]
    return {
        "peak": highest(steps, phases),
        "build": highest(steps[:1], ("build",)),
        "forward_backward_peak": highest(later, FORWARD_BACKWARD),
        "forward_backward_peak_step1": highest(steps[:1], FORWARD_BACKWARD),
        "update_peak": highest(steps, UPDATE),
        "resting_after_update": first_zero[0]["allocated"] if first_zero else None,
        "reserved_peak": max((e.get("reserved_peak") or 0 for s in steps for e in s["events"]),
                             default=0) or None,
        "per_phase": {p: {"step1": highest(steps[:1], (p,)), "later": highest(later, (p,))}
                      for p in phases},
    }  # fmt: skip


# --- the planner, in this process ----------------------------------------------------------


def plan(argv: list[str], modes: list[str]) -> tuple[dict, str]:
    """The planner's figures for the config, per mode (one rank), and the model's name."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moetrain.config import load_config
    from moetrain.loop.preflight import preflight
    from moetrain.parallelisms.dims import ParallelDims
    from moetrain.planner.layout_cost import measure_layout, peak_bytes, step_bytes, update_bytes

    cfg = load_config(list(argv))
    preflight(cfg, ParallelDims.of(cfg.parallel, 1))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        layout = measure_layout(cfg, 1, tuple(modes))
    finally:
        dist.destroy_process_group()
    s = layout.state
    resting = s.params[0] + s.optimizer[0]
    out = {
        "params": s.params[0], "grads": s.grads[0], "optimizer": s.optimizer[0],
        "update_transient": s.update[0], "fsdp_buffers": layout.fsdp_buffers,
        "resting_after_update": resting,
        "update_peak": resting + update_bytes(layout),
        "modes": {m: {"activations": layout.activations[m].activations,
                      "forward_backward_peak": resting + step_bytes(layout, m),
                      "peak": peak_bytes(layout, m)} for m in modes},
    }  # fmt: skip
    return out, cfg.job.name


def compare(planned: dict, measured: dict, mode: str) -> dict:
    """measured / planned for each figure both sides have."""
    p = {**planned, **planned["modes"][mode]}
    keys = ("peak", "forward_backward_peak", "update_peak", "resting_after_update")
    return {k: measured[k] / p[k] if measured.get(k) and p.get(k) else None for k in keys}


def table(result: dict) -> list[str]:
    big = max(m["peak"] for m in result["plan"]["modes"].values()) >= GIB
    unit, name = (GIB, "GiB") if big else (2**20, "MiB")
    gib = lambda n: "     -" if n is None else f"{n / unit:6.2f}"  # noqa: E731
    lines = [f"mode       {name}        peak  fwd/bwd  update  resting"]
    for mode, r in result["modes"].items():
        m = r.get("measured", {})  # none for a mode that failed
        p = {**result["plan"], **result["plan"]["modes"][mode]}
        for label, src in (("measured", m), ("planned", p)):
            lines.append(
                f"{mode if label == 'measured' else '':<10} {label:<9} {gib(src.get('peak'))} "
                f"{gib(src.get('forward_backward_peak'))} {gib(src.get('update_peak'))} "
                f"{gib(src.get('resting_after_update'))}"
            )
    return lines


def main() -> None:
    argv = sys.argv[1:]
    child = pop_flag(argv, "child-mode", None)
    steps = int(pop_flag(argv, "steps", "3"))
    per_block = pop_flag(argv, "per-block", "false", switch=True) == "true"
    device = pop_flag(argv, "device", None)
    if device:
        argv.append(f"--train.device={device}")
    if child:  # one mode, in this process
        result = measure_mode(argv, child, steps, per_block)
        print(json.dumps(result), flush=True)
        os._exit(0)  # as train.py: no interpreter teardown after the process group's work
    modes = pop_flag(argv, "modes", ",".join(MODES)).split(",")
    json_path = pop_flag(argv, "json", None)
    planned, name = plan(argv, modes)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = {"benchmark": "memory_phases", "date": time.strftime("%Y-%m-%d"), "config": name,
              "command": " ".join(["python benchmarks/memory_phases.py", *sys.argv[1:]]),
              "plan": planned, "modes": {}}  # fmt: skip
    for mode in modes:  # a fresh process each: no allocation of one mode outlives it
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv, f"--child-mode={mode}",
             f"--steps={steps}", *(["--per-block"] if per_block else [])],
            capture_output=True, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        if run.returncode != 0:  # e.g. out of memory: say so, and measure the other modes
            print(f"mode {mode} failed:\n{run.stderr[-4000:]}", file=sys.stderr)
            result["modes"][mode] = {"error": run.stderr[-2000:]}
            continue
        measured_raw = json.loads(run.stdout.strip().splitlines()[-1])
        measured = summarise(measured_raw)
        result["modes"][mode] = {
            "measured": measured,
            "ratio": compare(planned, measured, mode),
            "state": {"params": measured_raw["params"], "optimizer": measured_raw["optimizer"]},
            **{k: measured_raw.get(k) for k in ("device", "gpu", "torch", "alloc_retries")},
            "steps": measured_raw["steps"],
        }
    done = [r for r in result["modes"].values() if "error" not in r]
    result["device"] = (done[0].get("gpu") or done[0]["device"]) if done else None

    def part(mode: str) -> str:
        r = result["modes"][mode]
        if "error" in r:
            return f"{mode} failed"
        peak, ratio = r["measured"]["peak"], r["ratio"]["peak"]
        planned_peak = planned["modes"][mode]["peak"] / GIB
        if peak is None:
            return f"{mode} planned {planned_peak:.2f} GiB (not measured on {r['device']})"
        return f"{mode} {peak / GIB:.2f} GiB vs planned {planned_peak:.2f} ({ratio:.3f})"

    result["summary"] = f"memory_phases {name} on {result['device']}: " + "; ".join(
        map(part, modes)
    )
    write_result(result, json_path)
    print("\n".join(table(result)))
    print(result["summary"])


if __name__ == "__main__":
    main()
