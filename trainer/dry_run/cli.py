"""Will it fit? Plan a launch on one CPU process, before paying for the GPUs.

    python -m trainer.dry_run --world-size N --config X.toml [--section.key=value ...]
        [--json FILE] [--gpu-memory GiB] [--search] [--hardware h100|h200|h800]
        [--gpu-tflops F] [--efficiency E] [--intra-gbps B] [--inter-gbps B] [--ranks-per-node R]
        [--gemm-rates FILE] [--workers N]

The real mesh is built over PyTorch's fake process group (one process plays rank 0 of N;
collectives do nothing), the model on the meta device, the real plan applied. What it
prints, per rank: parameter, gradient and optimizer bytes (from the local shard shapes),
the activation peak of one micro-batch for each `train.activation_checkpoint` mode and the
rank's peak estimate; per step: FSDP all-gather and reduce-scatter bytes, the EP
all-to-all bytes under balanced routing and the CP ring bytes. Every refusal of a real
launch applies (`trainer.loop.setup.preflight`, exit 2). With --gpu-memory it says whether the
layout fits and, if not, which knob brings it in; last, the estimated step time on the
`--hardware` (and with --search the layouts that fit, fastest first:
`trainer.dry_run.search`; the model: `trainer.dry_run.step_cost`), its compute at the efficiency --gemm-rates FILE measured per
kind of kernel (`benchmarks/gemm_rates.py`'s JSON) where given, else at --efficiency;
--workers N: processes the search measures in (default: from the cores and the jobs to
run, `trainer.dry_run.workers.auto_workers`; 0: all in this one). How
each figure is measured: `trainer.dry_run.footprint` and docs/planner.md ("Will it
fit?").
"""

from __future__ import annotations

import copy
import json
import sys
import time

from trainer.dry_run.flags import HW_FLAGS, count, figure, hardware_overrides
from trainer.dry_run.hardware import (
    PRESETS,
    describe,
    efficiency_text,
    hardware,
    rates_by_kind,
    read_rates,
)
from trainer.dry_run.layout_cost import (
    MODES,
    Layout,
    Measured,
    measure_layout,
    peak_bytes,
    step_bytes,
    update_bytes,
)
from trainer.dry_run.search import flops_per_token, format_ranked, run_search
from trainer.dry_run.step_cost import estimate
from trainer.fileio import write_atomic

GIB = 2**30


# --- the report --------------------------------------------------------------------------


def _ranges(values: list[str]) -> list[tuple[str, str]]:
    """Collapse equal consecutive per-rank values: [('0-6', v), ('7', w)]."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((f"{start}" if i - start == 1 else f"{start}-{i - 1}", values[start]))
            start = i
    return out


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def report(layout: Layout, gpu_memory: float | None, suggestions: list[tuple[str, int]]) -> dict:
    cfg, dims, s = layout.cfg, layout.dims, layout.state
    world = dims.world_size
    per_rank = [
        {
            "rank": r,
            "params": s.params[r],
            "grads": s.grads[r],
            "optimizer": s.optimizer[r],
            "frozen": s.frozen[r],
        }  # fmt: skip
        for r in range(world)
    ]
    pc = layout.pipeline
    modes = {
        m: {
            "activation_peak": max(pc.activations[m]) if pc else t.activations,
            "saved_after_forward": t.saved_after_forward,
            "step_increase_rank0": step_bytes(layout, m),
            "peak_rank0": peak_bytes(layout, m),
        }
        for m, t in layout.activations.items()
    }
    out = {
        "model": cfg.model.name,
        "world_size": world,
        "layout": {
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "ep": dims.ep,
        },  # fmt: skip
        "micro_batch": [cfg.train.micro_batch_size, cfg.data.seq_len],
        "activation_checkpoint": cfg.train.activation_checkpoint,
        "per_rank": per_rank,
        "fsdp_buffers": layout.fsdp_buffers,
        # the update (norm, clip, optimizer step): gradients and the step's temporaries
        "update_increase_rank0": update_bytes(layout),
        "modes": modes,
        "per_step": layout.comm,
        "peak": peak_bytes(layout, cfg.train.activation_checkpoint),
    }
    if cfg.peft.method == "lora":
        out["frozen_base_dtype"] = cfg.peft.base_dtype
    if pc is not None:
        out["layout"].update(pp=dims.pp, pp_schedule=pc.schedule)
        out["pipeline"] = {
            "schedule": pc.schedule,
            "micro_batches": pc.micro_batches,
            "stage_flops_share": pc.flops_share,
            "hidden_bytes": pc.hidden_bytes,
            "pp_ranks": [{"stages": r.stages, "p2p_bytes": r.p2p, "step_buffers": r.step_buffers,
                          "activations": {m: a[i] for m, a in pc.activations.items()}}
                         for i, r in enumerate(pc.ranks)],
        }  # fmt: skip
    c, ac = layout.comm, cfg.train.activation_checkpoint
    out["fsdp_gather"] = {
        "configured": cfg.parallel.fsdp_gather,
        "micro_batch": {"all_gather": c["fsdp_all_gather"], "reduce_scatter":
                        c["fsdp_reduce_scatter"], "peak": peak_bytes(layout, ac, gather="micro_batch")},
        "step": {"all_gather": c["fsdp_all_gather_once"], "reduce_scatter":
                 c["fsdp_reduce_scatter_once"], "peak": peak_bytes(layout, ac, gather="step")},
    }  # fmt: skip
    if gpu_memory is not None:
        out["gpu_memory_gib"] = gpu_memory
        out["fits"] = out["peak"] <= gpu_memory * GIB
        out["suggestions"] = [{"flag": flag, "peak": peak} for flag, peak in suggestions]
        out["fsdp_gather"]["pick"] = pick_fsdp_gather(out["fsdp_gather"], c, gpu_memory * GIB)
    return out


def pick_fsdp_gather(options: dict, comm: dict, budget: float) -> str:
    """`step` where it moves fewer bytes (more than one micro-batch per step) and its peak
    fits the budget; else `micro_batch`, which needs the least memory."""
    step = options["step"]
    fewer = step["all_gather"] + step["reduce_scatter"] < (
        options["micro_batch"]["all_gather"] + options["micro_batch"]["reduce_scatter"]
    )
    return (
        "step" if comm["micro_batches"] > 1 and fewer and step["peak"] <= budget else "micro_batch"
    )


def format_report(r: dict) -> str:
    # GiB for real models, MiB for the debug ones
    unit, name = (GIB, "GiB") if r["peak"] >= GIB else (2**20, "MiB")
    g = lambda n: f"{n / unit:8.2f}"  # noqa: E731
    lay = r["layout"]
    pipe = r.get("pipeline")
    staged = f"pp {lay['pp']} ({lay['pp_schedule']}), " if pipe else ""
    lines = [
        f"{r['model']} on {r['world_size']} ranks: {staged}dp_replicate {lay['dp_replicate']}, "
        f"dp_shard {lay['dp_shard']}, cp {lay['cp']}, ep {lay['ep']}; micro-batch "
        f"{r['micro_batch'][0]} x {r['micro_batch'][1]} tokens, "
        f"{r['per_step']['micro_batches']} per step",
        "",
        f"{name} per rank   params    grads  optimizer",
    ]
    rows = [f"{g(p['params'])} {g(p['grads'])} {g(p['optimizer'])}" for p in r["per_rank"]]
    for ranks, row in _ranges(rows):  # ranks whose figures print alike share a line
        lines.append(f"ranks {ranks:<8}{row}")
    if "frozen_base_dtype" in r:  # LoRA: how much of params is the base (peft.base_dtype)
        held = [f"{g(p['frozen']).strip()}" for p in r["per_rank"]]
        where = ", ".join(f"ranks {ranks} {v}" for ranks, v in _ranges(held))
        lines.append(
            f"(of the params, the frozen base in {r['frozen_base_dtype']}: {where} {name})"
        )
    lines += ["", "activation_checkpoint  activations  rank peak (+ FSDP buffers "
              f"{r['fsdp_buffers'] / unit:.2f} {name})"]  # fmt: skip
    for mode, m in r["modes"].items():
        mark = "  <- configured" if mode == r["activation_checkpoint"] else ""
        lines.append(f"{mode:<22}{g(m['activation_peak'])}     {g(m['peak_rank0'])}{mark}")
    lines.append(f"(a rank peak is the higher of the forward/backward and the optimizer step, "
                 f"which adds {r['update_increase_rank0'] / unit:.2f} {name}: gradients and "
                 "its temporaries)")  # fmt: skip
    if pipe:
        lines.append("pp rank  stages     activations per mode (none/selective/full)   sends")
        for i, q in enumerate(pipe["pp_ranks"]):
            acts = "/".join(f"{a / unit:.2f}" for a in q["activations"].values())
            lines.append(f"{i:<8} {','.join(map(str, q['stages'])):<10} {acts:<44} "
                         f"{q['p2p_bytes'] / unit:.2f} {name}")  # fmt: skip
        lines.append("(under pp, FSDP keeps a stage's units gathered and its gradients "
                     "unsharded through the step, and gathers and reduces once per step: "
                     "parallel.fsdp_gather does not apply)")  # fmt: skip
    c = r["per_step"]
    lines += [
        "",
        f"per step, per rank ({name}): FSDP all-gather {c['fsdp_all_gather'] / unit:.2f}, "
        f"reduce-scatter {c['fsdp_reduce_scatter'] / unit:.2f}"
        + (f", HSDP all-reduce {c['hsdp_all_reduce'] / unit:.2f}" if c["hsdp_all_reduce"] else "")
        + f"; EP all-to-all {c['ep_all_to_all'] / unit:.2f} (balanced routing; "
        f"{c['ep_all_to_all_full_ac'] / unit:.2f} with full checkpointing); CP ring "
        f"{c['cp_ring'] / unit:.2f}",
    ]
    f = r["fsdp_gather"]
    for mode, label in () if pipe else (("micro_batch", "per micro-batch"), ("step", "once per step")):  # fmt: skip
        o = f[mode]
        mark = "  <- configured" if mode == f["configured"] else ""
        mark += "  <- pick" if f.get("pick") == mode else ""
        lines.append(
            f"FSDP gathers {label:<16} all-gather {o['all_gather'] / unit:.2f}, reduce-scatter "
            f"{o['reduce_scatter'] / unit:.2f}, peak {_size(o['peak'])}"
            f" (--parallel.fsdp_gather={mode}){mark}"
        )
    if "fits" in r:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"\n--gpu-memory {r['gpu_memory_gib']:g}: peak {_size(r['peak'])}: {verdict}")
        for s in r["suggestions"]:
            lines.append(f"  fits with {s['flag']} ({_size(s['peak'])})")
        if not r["fits"] and not r["suggestions"]:
            lines.append("  no single knob tried brings it in (see docs: Will it fit?)")
    return "\n".join(lines)


def suggest(
    layout: Layout, world_size: int, budget: float, reuse: Measured | None = None
) -> list[tuple[str, int]]:
    """Single knobs that bring the rank's peak under `budget` bytes, cheapest first:
    checkpointing, then a smaller micro-batch, then more expert parallelism, then more
    FSDP sharding (fewer replicas). `reuse`: what earlier measurements of this model hold."""
    cfg = layout.cfg
    if peak_bytes(layout, cfg.train.activation_checkpoint) <= budget:
        return []
    found = []
    for mode in MODES:
        if mode != cfg.train.activation_checkpoint and peak_bytes(layout, mode) <= budget:
            found.append((f"--train.activation_checkpoint={mode}", peak_bytes(layout, mode)))
            break
    mb = cfg.train.micro_batch_size // 2
    while mb >= 1 and not found[1:]:
        trial = _variant(cfg, train={"micro_batch_size": mb})
        measured = measure_layout(trial, world_size, (cfg.train.activation_checkpoint,), reuse)
        peak = peak_bytes(measured, cfg.train.activation_checkpoint)
        if peak <= budget:
            found.append((f"--train.micro_batch_size={mb}", peak))
        mb //= 2
    for key, value in _layout_knobs(layout):
        trial = _variant(cfg, parallel={key: value})
        try:
            measured = measure_layout(trial, world_size, (cfg.train.activation_checkpoint,), reuse)
        except ValueError:  # a layout this model or batch cannot take
            continue
        peak = peak_bytes(measured, cfg.train.activation_checkpoint)
        if peak <= budget:
            found.append((f"--parallel.{key}={value}", peak))
            break
    return found


def _layout_knobs(layout: Layout) -> list[tuple[str, int]]:
    d = layout.dims
    knobs = [("ep", d.ep * f) for f in (2, 4) if (d.dp_shard * d.cp) % (d.ep * f) == 0]
    if d.dp_replicate > 1:
        knobs.append(("dp_shard", d.dp_shard * d.dp_replicate))  # pure FSDP
    return knobs


def _variant(cfg, **sections):
    trial = copy.deepcopy(cfg)
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(trial, section), key, value)
    if "dp_shard" in sections.get("parallel", {}):
        trial.parallel.dp_replicate = 1
    return trial


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {"--world-size": None, "--json": None, "--gpu-memory": None, "--hardware": "h100",
             "--gemm-rates": None, "--workers": None, **dict.fromkeys(HW_FLAGS)}  # fmt: skip
    search_flag = "--search" in argv
    argv = [a for a in argv if a != "--search"]
    rest = []
    while argv:
        arg = argv.pop(0)
        name, eq, value = arg.partition("=")
        if name in flags:
            flags[name] = value if eq else (argv.pop(0) if argv else None)
        else:
            rest.append(arg)
    from trainer.config import ConfigError, load_config
    from trainer.errors import USER_ERRORS

    try:
        if flags["--world-size"] is None:
            raise ConfigError("give the launch's size: --world-size N (all ranks of all nodes)")
        world_size = count("--world-size", flags["--world-size"], 1)
        gpu_memory = (
            figure("--gpu-memory", flags["--gpu-memory"]) if flags["--gpu-memory"] else None
        )
        workers = flags["--workers"]
        if workers is not None and not workers.isdigit():
            raise ConfigError(f"--workers {workers!r}: give a count of processes, 0 or more")
        workers = None if workers is None else int(workers)
        if workers is not None and not search_flag:
            raise ConfigError("--workers sets the processes of a --search: add --search")
        if flags["--hardware"] not in PRESETS:
            raise ConfigError(
                f"--hardware {flags['--hardware']!r}: use one of {', '.join(PRESETS)}"
            )
        hw = hardware(flags["--hardware"], **hardware_overrides(flags))
        if not any(a == "--config" or a.startswith("--config=") for a in rest):
            raise ConfigError("no --config given: pass --config FILE.toml")
        cfg = load_config(rest)
        p = cfg.parallel
        from parallelisms.dims import ParallelDims, check_ep_nodes
        from trainer.loop.setup import preflight

        dims = ParallelDims.of(p, world_size)
        # the planned machines' nodes too (a planning process has no LOCAL_WORLD_SIZE)
        per_node = p.ranks_per_node or hw.ranks_per_node
        if per_node < world_size:
            where = "parallel.ranks_per_node, else --ranks-per-node or the --hardware preset"
            check_ep_nodes(p.ep, per_node, where)
        preflight(cfg, dims)  # every refusal of a real launch
        flops = flops_per_token(cfg)
        rates = read_rates(flags["--gemm-rates"]) if flags["--gemm-rates"] else None
        by_kind = rates_by_kind(rates, flops, hw) if rates else None
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # One cache for the search, the configured layout and the suggestions: they share
        # shardings and traces (layout_cost.Measured). The search goes first: its worker
        # processes trace while this one shards, and the others are mostly among its
        # candidates.
        reuse = Measured()
        if search_flag:
            budget = (gpu_memory or hw.memory_gib) * GIB
            log = lambda m: print(m, file=sys.stderr)  # noqa: E731
            ranked = run_search(cfg, world_size, hw, budget, log, by_kind, reuse, workers)
        layout = measure_layout(cfg, world_size, reuse=reuse)
        suggestions = suggest(layout, world_size, gpu_memory * GIB, reuse) if gpu_memory else []
        mode = cfg.train.activation_checkpoint
        configured = estimate(layout, mode, flops, hw, by_kind)
    finally:
        dist.destroy_process_group()
    result = report(layout, gpu_memory, suggestions)
    result["hardware"] = describe(hw)
    result["flops_per_token"] = flops
    result["estimate"] = configured
    efficiency = efficiency_text(hw, by_kind, rates)
    if rates:
        result["gemm_rates"] = {**rates, "flops_by_kind": {k: f for k, (f, _) in by_kind.items()},
                                "efficiency_used": {k: e for k, (_, e) in by_kind.items()}}  # fmt: skip
    lines = [format_report(result), "", (
        f"estimated step on {world_size} ranks, nodes of {hw.name}: {configured['step_s']:.3f} s, "
        f"{configured['tokens_per_s']:,.0f} tok/s (compute {configured['compute_s']:.3f} s at "
        f"{efficiency}; all-to-all "
        f"{configured['comm_s']['ep_all_to_all']:.3f} s{_hidden_text(configured, cfg)}; "
        f"FSDP {configured['comm_s']['fsdp']:.3f} s, "
        f"ring {configured['comm_s']['cp_ring']:.3f} s, HSDP {configured['comm_s']['hsdp']:.3f} s "
        f"under compute, {configured['exposed_background_s']:.3f} s exposed)")]  # fmt: skip
    if search_flag:
        result["search"] = ranked
        lines += ["", *format_ranked(ranked, hw, efficiency=efficiency)]
    result["planning_s"] = round(time.perf_counter() - start, 1)
    print("\n".join(lines))
    if flags["--json"]:
        write_atomic(flags["--json"], json.dumps(result, indent=1))
    return 0


def _hidden_text(estimate: dict, cfg) -> str:
    """What of the all-to-all the estimate puts under compute (`parallel.ep_overlap`)."""
    hidden = estimate.get("ep_hidden_s")
    if not hidden:
        return ""
    return f", {hidden:.3f} s of it under compute (parallel.ep_overlap={cfg.parallel.ep_overlap})"
