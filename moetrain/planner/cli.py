"""Will it fit? Plan a launch on one CPU process, before paying for the GPUs.

    python -m moetrain.planner --world-size N --config X.toml [--section.key=value ...]
        [--json FILE] [--gpu-memory GiB] [--search] [--hardware h100|h200|h800]
        [--gpu-tflops F] [--gpu-fp8-tflops F] [--efficiency E] [--intra-gbps B]
        [--inter-gbps B] [--ranks-per-node R] [--memory-gbps B] [--memory-reserve GiB]
        [--routing-imbalance F] [--gemm-rates FILE] [--workers N]

The real mesh is built over PyTorch's fake process group (one process plays rank 0 of N;
collectives do nothing), the model on the meta device, the real plan applied. What it
prints, per rank: parameter, gradient and optimizer bytes (from the local shard shapes),
the activation peak of one micro-batch for each `train.activation_checkpoint` mode and the
rank's peak estimate; per step: FSDP all-gather and reduce-scatter bytes, the EP
all-to-all bytes under balanced routing and the CP ring bytes. Every refusal of a real
launch applies (`moetrain.loop.preflight.preflight`, exit 2). With --gpu-memory (GiB the GPU
exposes; --memory-reserve of it, 2 by default, kept for the CUDA context and NCCL's
buffers) it says whether the layout fits and, if not, which knob brings it in; the busiest
expert-parallel rank saves --routing-imbalance (1.1) times the balanced routed rows; last, the estimated step time on the
`--hardware` (and with --search the layouts that fit, fastest first:
`moetrain.planner.search`; the model: `moetrain.planner.step_cost`), its compute at the efficiency --gemm-rates FILE measured per
kind of kernel (`benchmarks/gemm_rates.py`'s JSON) where given, else at --efficiency;
--workers N: processes the search measures in (default: from the cores and the jobs to
run, `moetrain.planner.workers.auto_workers`; 0: all in this one). How
each figure is measured: `moetrain.planner.footprint` and docs/planner.md ("Will it
fit?").
"""

from __future__ import annotations

import copy
import json
import sys
import time

from moetrain.config.checks import config_problems
from moetrain.fileio import write_atomic
from moetrain.planner.flags import HW_FLAGS, count, figure, hardware_overrides
from moetrain.planner.hardware import (
    PRESETS,
    describe,
    efficiency_text,
    hardware,
    rates_by_kind,
    read_rates,
    usable_gib,
)
from moetrain.planner.layout_cost import (
    MODES,
    ROUTING_IMBALANCE,
    Layout,
    Measured,
    measure_layout,
    peak_bytes,
)
from moetrain.planner.model_counts import flops_per_token, parameter_counts
from moetrain.planner.report import GIB, estimate_notes, format_report, report
from moetrain.planner.search import format_ranked, run_search
from moetrain.planner.step_cost import estimate


def suggest(
    layout: Layout,
    world_size: int,
    budget: float,
    reuse: Measured | None = None,
    imbalance: float = ROUTING_IMBALANCE,
) -> list[tuple[str, int]]:
    """Single knobs that bring the rank's peak under `budget` bytes, cheapest first:
    checkpointing, then a smaller micro-batch, then more expert parallelism, then more
    FSDP sharding (fewer replicas). `reuse`: what earlier measurements of this model hold;
    `imbalance`: --routing-imbalance, which each is measured at."""
    cfg = layout.cfg
    configured = (cfg.train.activation_checkpoint,)
    if peak_bytes(layout, cfg.train.activation_checkpoint) <= budget:
        return []
    found = []
    for mode in MODES:
        if mode == cfg.train.activation_checkpoint or peak_bytes(layout, mode) > budget:
            continue
        if _refused(_variant(cfg, train={"activation_checkpoint": mode}), cfg):
            continue  # (full under a V schedule: the launch would refuse it)
        found.append((f"--train.activation_checkpoint={mode}", peak_bytes(layout, mode)))
        break
    mb = cfg.train.micro_batch_size // 2
    while mb >= 1 and not found[1:]:
        trial = _variant(cfg, train={"micro_batch_size": mb})
        if _refused(trial, cfg):
            break
        measured = measure_layout(trial, world_size, configured, reuse, imbalance)
        peak = peak_bytes(measured, cfg.train.activation_checkpoint)
        if peak <= budget:
            found.append((f"--train.micro_batch_size={mb}", peak))
        mb //= 2
    for key, value in _layout_knobs(layout):
        trial = _variant(cfg, parallel={key: value})
        if _refused(trial, cfg):
            continue
        try:
            measured = measure_layout(trial, world_size, configured, reuse, imbalance)
        except ValueError:  # a layout this model or batch cannot take
            continue
        peak = peak_bytes(measured, cfg.train.activation_checkpoint)
        if peak <= budget:
            found.append((f"--parallel.{key}={value}", peak))
            break
    return found


def _refused(trial, cfg) -> bool:
    """Whether a launch would refuse `trial` for a reason it would not refuse `cfg` for."""
    return not set(config_problems(trial)) <= set(config_problems(cfg))


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
    flags = {
        "--world-size": None,
        "--json": None,
        "--gpu-memory": None,
        "--hardware": "h100",
        "--gemm-rates": None,
        "--workers": None,
        "--routing-imbalance": None,
        **dict.fromkeys(HW_FLAGS),
    }
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
    from moetrain.config import ConfigError, load_config
    from moetrain.errors import USER_ERRORS

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
        imbalance = flags["--routing-imbalance"]
        imbalance = figure("--routing-imbalance", imbalance) if imbalance else ROUTING_IMBALANCE
        if not any(a == "--config" or a.startswith("--config=") for a in rest):
            raise ConfigError("no --config given: pass --config FILE.toml")
        cfg = load_config(rest)
        p = cfg.parallel
        from moetrain.loop.preflight import preflight
        from moetrain.parallelisms.dims import ParallelDims, check_ep_nodes
        from moetrain.parallelisms.flash_attn_support import (
            CUTLASS_VERSION,
            FlashAttnHost,
        )
        from moetrain.parallelisms.flash_attn_support import VERSION as FLASH_ATTN_VERSION

        dims = ParallelDims.of(p, world_size)
        # the planned machines' nodes too (a planning process has no LOCAL_WORLD_SIZE)
        per_node = p.ranks_per_node or hw.ranks_per_node
        if per_node < world_size:
            where = "parallel.ranks_per_node, else --ranks-per-node or the --hardware preset"
            check_ep_nodes(p.ep, per_node, where)
        # Every refusal of a real launch, on the machines planned: GPUs unless the config
        # says CPU (the planner's rule: planner/shards.py), every preset a Hopper part with
        # the pinned flash-attn-4, not this machine: a plan is made before them.
        planned = None
        if cfg.train.device != "cpu":
            planned = FlashAttnHost("cuda", (9, 0), FLASH_ATTN_VERSION, CUTLASS_VERSION)
        preflight(cfg, dims, planned)
        flops = flops_per_token(cfg)
        parameters = parameter_counts(cfg)
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
        budget = usable_gib(hw, gpu_memory) * GIB
        if search_flag:
            log = lambda m: print(m, file=sys.stderr)  # noqa: E731
            ranked = run_search(
                cfg, world_size, hw, budget, log, by_kind, reuse, workers, imbalance
            )
        layout = measure_layout(cfg, world_size, reuse=reuse, routing_imbalance=imbalance)
        suggestions = suggest(layout, world_size, budget, reuse, imbalance) if gpu_memory else []
        mode = cfg.train.activation_checkpoint
        configured = estimate(layout, mode, flops, hw, by_kind)
    finally:
        dist.destroy_process_group()
    result = report(layout, gpu_memory, suggestions, hw.reserve_gib)
    result["hardware"] = describe(hw)
    result["flops_per_token"] = flops
    result["parameters"] = parameters
    result["estimate"] = configured
    efficiency = efficiency_text(hw, by_kind, rates)
    if rates:
        result["gemm_rates"] = {
            **rates,
            "flops_by_kind": {k: f for k, (f, _) in by_kind.items()},
            "efficiency_used": {k: e for k, (_, e) in by_kind.items()},
        }
    lines = [
        format_report(result),
        "",
        (
            f"estimated step on {world_size} ranks, nodes of {hw.name}: {configured['step_s']:.3f} s, "
            f"{configured['tokens_per_s']:,.0f} tok/s (compute {configured['compute_s']:.3f} s at "
            f"{efficiency}; all-to-all "
            f"{configured['comm_s']['ep_all_to_all']:.3f} s{_hidden_text(configured, cfg)}; "
            f"FSDP {configured['comm_s']['fsdp']:.3f} s, "
            f"ring {configured['comm_s']['cp_ring']:.3f} s, HSDP {configured['comm_s']['hsdp']:.3f} s "
            f"under compute, {configured['exposed_background_s']:.3f} s exposed; optimizer step "
            f"{configured['optimizer_s']:.3f} s at {hw.memory_gbps:g} GB/s)"
        ),
        *estimate_notes(configured, cfg, flops),
    ]
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
