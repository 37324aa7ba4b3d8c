"""Peak activation memory and step time per activation-checkpointing mode, on CPU.

    python benchmarks/memory.py --config configs/debug_qwen3_moe.toml [--section.key=value ...]

Runs the config once per `train.activation_checkpoint` mode (none, full, selective), each
in a fresh process of one rank, and prints one JSON object, then a one-line summary.
Flags of this script (not config keys): --modes=none,full,selective, --warmup=K (untimed
steps, default 1), --measure=M (timed steps, default 3).

Memory is read from the allocator, not estimated: one step's forward and backward run
under `torch.profiler` with `profile_memory=True`, which records every CPU allocation and
free; `peak_mib` is the highest live total above what was live when the step began (the
weights and the optimizer state). It includes the gradients (`grads_mib`, the same for
every mode); `activations_mib = peak_mib - grads_mib` is what checkpointing changes.
Step time is the median of the timed steps, without the profiler. `block_bytes`: per plan
block, what its forward leaves allocated for the backward (`block_activation_bytes`, the
figure the planner's activation model gives per block).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.step_time import pop_flag  # noqa: E402

MODES = ("none", "full", "selective")
MIB = 2**20


def peak_bytes(fn, before=None) -> int:
    """The peak of live CPU memory while `fn()` runs, above the level when it starts, from
    the allocator's events (every allocation and free, in time order). `before()` runs
    first under the same profiler, so that what `fn` frees of its allocations is seen too
    (the profiler drops frees of blocks allocated before it started)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if before is not None:
            before()
        with record_function("measured"):
            fn()
    (window,) = named_ranges(prof, "measured").values()
    live, level, peak = 0, 0, 0
    for start, nbytes in session_allocations(prof):
        if start > window[1]:
            break
        live += nbytes
        if start < window[0]:
            level = live
        else:
            peak = max(peak, live - level)
    return peak


def _profiled_events(prof):
    """Every event of a finished profile (its ops and allocations), depth first."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def session_allocations(prof) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every CPU allocation and free of the
    profile `prof`, in time order, leaving out the frees of blocks it did not see allocated.

    NOTE: the CPU allocator's reporter keeps the size of every block allocated while any
    profiler recorded memory, in one table for the whole process, and reports a free of a
    block it knows with that size. So a block an earlier profiled measurement allocated (or
    a stale entry whose address the allocator gave out again unrecorded) freed during this
    profile came in as a free of this window: the figures then depended on what ran before
    in the process (DeepSeek-V3's MTP block gave 2.58 and 1.92 MB instead of 3.11 MB, a
    block under `full` -18.8 MB after a Trainer had run). A free counts only if this
    profile saw the block allocated."""
    from torch._C._profiler import _EventType

    records = sorted(
        (e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
        for e in _profiled_events(prof)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"
    )
    born: set[int] = set()
    out = []
    for start, ptr, nbytes in records:
        if nbytes > 0:
            born.add(ptr)
        elif ptr in born:
            born.discard(ptr)
        else:
            continue  # a block allocated before this profile: not its memory
        out.append((start, nbytes))
    return out


def named_ranges(prof, prefix: str) -> dict[str, tuple[int, int]]:
    """name -> (start, end) ns of the profile's `record_function` ranges named `prefix`..."""
    from torch._C._profiler import _EventType

    return {
        e.name: (e.start_time_ns, e.end_time_ns)
        for e in _profiled_events(prof)
        if e.tag == _EventType.TorchOp and e.name.startswith(prefix)
    }


def block_activation_bytes(argv: list[str], mode: str) -> dict[str, int]:
    """Per plan block (FQN): the bytes its forward leaves allocated for the backward (what
    autograd saves, plus the block's output), for one micro-batch of the config on CPU in
    fp32, read from the allocator's events inside the block's forward window. The attention
    cores run the fused CPU kernel (`use_fused_attention`).

    NOTE: the planner's activation model (`moetrain.planner.activation_trace.trace_step`) measures
    the same quantity on the meta device (`StepTrace.saved_by_structure`);
    tests/test_activation_checkpoint.py holds the two within 5% of each other."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.activation_checkpoint import apply_activation_checkpointing
    from moetrain.parallelisms.plan import match_modules
    from moetrain.planner.meta_trace import use_fused_attention

    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.args)
    model.init_weights(cfg.train.seed)
    # the fused attention kernel the planner assumes (a GPU run's; on CPU, SDPA with MLA's
    # two head dims takes its math path, which saves the [S, S] scores)
    use_fused_attention(model, spec.plan)
    blocks = match_modules(model, spec.plan.blocks, "blocks")
    apply_activation_checkpointing(blocks, mode)
    model.train()
    B, S = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(
        0, cfg.model.args.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)
    )
    depth = getattr(cfg.model.args, "num_nextn_predict_layers", 0)
    extra = {"mtp_input_ids": ids[..., None].expand(B, S, depth)} if depth else {}
    ranges: dict[str, record_function] = {}

    def enter(fqn):
        def hook(*_) -> None:  # (a pre-hook returning a value would replace the inputs)
            ranges.setdefault(fqn, record_function(f"block:{fqn}")).__enter__()

        return hook

    def leave(fqn):
        def hook(*_) -> None:
            ranges.pop(fqn).__exit__(None, None, None)

        return hook

    hooks = [h for fqn, b in blocks for h in (b.register_forward_pre_hook(enter(fqn)),
                                              b.register_forward_hook(leave(fqn)))]  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(ids, **extra)
    del out
    for h in hooks:
        h.remove()
    memory = session_allocations(prof)
    return {
        name.removeprefix("block:"): sum(n for t, n in memory if start <= t <= end)
        for name, (start, end) in named_ranges(prof, "block:").items()
    }


def measure_mode(argv: list[str], mode: str, warmup: int, measure: int) -> dict:
    """One rank, this process: a Trainer with `mode`, timed steps, then one profiled step."""
    from moetrain.config import load_config
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer
    from moetrain.parallelisms.dims import ParallelDims

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            [
                *argv,
                f"--train.activation_checkpoint={mode}",
                "--train.device=cpu",
                "--metrics.jsonl=false",
                "--metrics.progress=false",
                f"--job.output_dir={tmp}",
            ]
        )
        p = cfg.parallel
        dims = ParallelDims.of(p, 1)
        cfg.train.steps = warmup + measure + 2
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, cfg.train.steps)
        corpora = preflight(cfg, dims)
        trainer = Trainer(cfg, dims, corpora)
        times = []
        for i in range(warmup + measure):
            batches = trainer.next_micro_batches()
            start = time.perf_counter()
            trainer.steps.train_step(batches)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        before, batches = trainer.next_micro_batches(), trainer.next_micro_batches()
        peak = peak_bytes(
            lambda: trainer.forward_backward(batches), lambda: trainer.steps.train_step(before)
        )
        grads = sum(q.numel() * q.element_size() for q in trainer.params)
        return {
            "mode": mode,
            "config": cfg.job.name,
            "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
            "micro_batch": [cfg.train.micro_batch_size, cfg.data.seq_len],
            "step_time_s": statistics.median(times),
            "peak_mib": peak / MIB,
            "grads_mib": grads / MIB,
            "activations_mib": (peak - grads) / MIB,
            # what each block's forward leaves for its backward (and its output), bytes
            "block_bytes": block_activation_bytes(argv, mode),
        }


def main() -> None:
    argv = sys.argv[1:]
    child = pop_flag(argv, "child-mode", "")
    warmup = int(pop_flag(argv, "warmup", "1"))
    measure = int(pop_flag(argv, "measure", "3"))
    if child:  # one mode, in this process
        print(json.dumps(measure_mode(argv, child, warmup, measure)))
        return
    modes = pop_flag(argv, "modes", ",".join(MODES)).split(",")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    results = {}
    for mode in modes:  # a fresh process each: no allocation of one mode outlives it
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv, f"--child-mode={mode}",
             f"--warmup={warmup}", f"--measure={measure}"],
            check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    first = results[modes[0]]
    print(json.dumps({"config": first["config"], "modes": results}))
    base = results.get("none")

    def part(mode: str) -> str:
        r = results[mode]
        text = f"{mode} {r['activations_mib']:.1f} MiB ({max(r['block_bytes'].values())} B/block)"
        if base is not None and mode != "none":
            text += f" ({100 * (r['activations_mib'] / base['activations_mib'] - 1):+.0f}%)"
        return f"{text}, {1000 * r['step_time_s']:.0f} ms/step"

    print(f"{first['config']} activation memory (peak - grads): {'; '.join(map(part, modes))}")


if __name__ == "__main__":
    main()
