"""Which layout is fastest? Every candidate layout (`candidates`) measured
(`moetrain.planner.layout_cost`) under each checkpointing mode, those that fit ranked by
the step-time model (`moetrain.planner.step_cost.estimate`): `python -m moetrain.planner ...
--search` (docs/planner.md, "Step-time model").
"""

from __future__ import annotations

from moetrain.parallelisms.dims import V_SCHEDULES, ep_fits_nodes
from moetrain.planner.hardware import (  # noqa: F401  (also read from here: tests, benchmarks)
    PRESETS,
    Hardware,
    efficiency_text,
    hardware,
    rates_by_kind,
    read_rates,
)
from moetrain.planner.layout_cost import (
    MODES,
    ROUTING_IMBALANCE,
    Measured,
    measure_layout,
    measure_state,
    peak_bytes,
)
from moetrain.planner.model_counts import flops_per_token, trunk_block_count
from moetrain.planner.step_cost import estimate
from moetrain.planner.workers import SearchPool, auto_workers, search_jobs

# parallel.ep_overlap's forms the search weighs where ep > 1 (none hides nothing)
OVERLAP_FORMS = ("shared", "chunks")

# Pipeline schedules the search tries for pp > 1, with their virtual stages per rank.
SEARCH_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))


def candidates(cfg, world_size: int, hw: Hardware, blocks: int = 0) -> list[dict]:
    """Layouts to try: pipeline stages (pp and schedule; `blocks`: the model's trunk
    blocks, which each stage needs one of), HSDP across nodes or not, cp, ep, micro-batch
    (each a dict of `parallel`/`train` values); the checkpointing modes come with each
    measurement, and a layout the model cannot take (ep not dividing its experts) is
    dropped when measured."""
    from moetrain.parallelisms.dims import pipeline_micro_batches_needed

    node = hw.ranks_per_node
    out = []
    for pp in (1, 2, 4, 8, 16):
        stage_world = world_size // pp
        if world_size % pp or (pp > 1 and blocks < pp):
            continue
        schedules = (
            [(s, v) for s, v in SEARCH_SCHEDULES if blocks >= pp * v] if pp > 1 else [("1F1B", 1)]
        )
        # NOTE: with pipeline stages, plain FSDP inside each and no ring: the search stays
        # within its time (each stage cut and degree is measured afresh), and both are
        # there to cut memory, which stages already divide.
        replicas = {1} | (
            {stage_world // node}
            if pp == 1 and stage_world > node and stage_world % node == 0
            else set()
        )
        for rep in sorted(replicas):
            shard_world = stage_world // rep
            for cp in (1, 2, 4, 8) if pp == 1 else (1,):
                if cp > min(node, shard_world) or shard_world % cp or cfg.data.seq_len % (2 * cp):
                    continue
                dp = stage_world // cp
                for ep in (1, 2, 4, 8, 16, 32, 64):
                    if ep > shard_world or shard_world % ep or not ep_fits_nodes(ep, node):
                        continue
                    for mb in (1, 2, 4):
                        if cfg.train.global_batch_size % (dp * mb):
                            continue
                        n = cfg.train.global_batch_size // (dp * mb)
                        for schedule, v in schedules:
                            if pp > 1 and pipeline_micro_batches_needed(schedule, pp, n):
                                continue
                            staged = {"pp": pp, "pp_schedule": schedule, "pp_virtual_stages": v}
                            out.append(
                                {
                                    "parallel": {
                                        "dp_replicate": rep,
                                        "dp_shard": shard_world // cp,
                                        "cp": cp,
                                        "ep": ep,
                                        **staged,
                                    },
                                    "train": {"micro_batch_size": mb},
                                }
                            )
    return out


def run_search(
    cfg,
    world_size: int,
    hw: Hardware,
    budget: float,
    log=print,
    by_kind: dict | None = None,
    reuse=None,
    workers: int | None = None,
    imbalance: float = ROUTING_IMBALANCE,
) -> list[dict]:
    """Every candidate x checkpointing mode that fits `budget` bytes, fastest first (`by_kind`:
    measured efficiencies, as `estimate` takes them; `reuse`: a `layout_cost.Measured` to
    share with earlier measurements of this model; `workers`: processes that measure
    meanwhile, None: `workers.auto_workers`, 0: none; `imbalance`: the busiest
    expert-parallel rank's routed rows over the mean, `--routing-imbalance`)."""
    import copy

    from moetrain.config import ConfigError

    flops = flops_per_token(cfg)
    tried = candidates(cfg, world_size, hw, trunk_block_count(cfg))
    trials = []
    for cand in tried:
        trial = copy.deepcopy(cfg)
        for section, values in cand.items():
            for key, value in values.items():
                setattr(getattr(trial, section), key, value)
        trials.append(trial)
    # Candidates share shardings (all micro-batch sizes) and traces (every degree but cp):
    # each is measured once (layout_cost.Measured), most in worker processes while this
    # one shards the pipeline stages (moetrain.planner.workers).
    reuse = reuse if reuse is not None else Measured()
    jobs = search_jobs(trials, world_size, reuse)
    workers = auto_workers(len(jobs)) if workers is None else workers
    pool = SearchPool(world_size, workers) if workers > 0 and jobs else None
    try:
        if pool is not None:
            pool.submit(jobs)
            log(f"  {len(jobs)} traces and shardings on {workers} worker process(es) and this one")
            for trial in trials:
                try:
                    if trial.parallel.pp > 1:
                        measure_state(trial, world_size, reuse)
                except (ValueError, ConfigError):
                    pass  # measured again below, which reports it
            pool.take_back(reuse)
        found = (world_size, hw, budget, log, by_kind, reuse, flops, imbalance)
        return _rank(tried, trials, *found)
    finally:
        if pool is not None:
            pool.close()


def _rank(
    tried, trials, world_size, hw, budget, log, by_kind, reuse, flops, imbalance
) -> list[dict]:
    from moetrain.config import ConfigError

    ranked = []
    for i, (cand, trial) in enumerate(zip(tried, trials, strict=True), start=1):
        try:
            layout = measure_layout(trial, world_size, reuse=reuse, routing_imbalance=imbalance)
        except (ValueError, ConfigError) as err:  # e.g. ep not dividing the experts
            log(f"  [{i}/{len(tried)}] {cand['parallel']} skipped: {err}")
            continue
        for mode in MODES:
            if (
                trial.parallel.pp > 1
                and mode == "full"
                and trial.parallel.pp_schedule in V_SCHEDULES
            ):
                continue  # their split backward cannot replay a whole block (config)
            trial.train.activation_checkpoint = mode
            peak = peak_bytes(layout, mode)
            if peak > budget:
                continue
            # each way to overlap the all-to-all, the fastest kept (the same memory)
            forms = OVERLAP_FORMS if trial.parallel.ep > 1 else (trial.parallel.ep_overlap,)
            form, est = max(
                ((f, estimate(layout, mode, flops, hw, by_kind, f)) for f in forms),
                key=lambda pair: pair[1]["tokens_per_s"],
            )
            ranked.append(
                {
                    **cand["parallel"],
                    "micro_batch_size": cand["train"]["micro_batch_size"],
                    "activation_checkpoint": mode,
                    "ep_overlap": form,
                    "peak": peak,
                    "comm_bytes": layout.comm,
                    **est,
                }
            )
        log(
            f"  [{i}/{len(tried)}] measured {cand['parallel']}, micro-batch {cand['train']['micro_batch_size']}"
        )
    ranked.sort(key=lambda r: -r["tokens_per_s"])
    return ranked


def format_ranked(
    ranked: list[dict], hw: Hardware, top: int = 10, efficiency: str = ""
) -> list[str]:
    """`efficiency`: `efficiency_text`'s words (default: the constant's)."""
    efficiency = efficiency or efficiency_text(hw, None, None)
    lines = [
        f"fastest layouts that fit ({hw.name}: {efficiency}, "
        f"{hw.intra_gbps:g} GB/s in a node, {hw.inter_gbps:g} GB/s across, "
        f"{hw.ranks_per_node} per node):",
        "      tok/s     step s   compute       a2a   exposed    bubble  layout",
    ]
    for r in ranked[:top]:
        lines.append(
            f"  {r['tokens_per_s']:>9,.0f}  {r['step_s']:9.3g} {r['compute_s']:9.3g} "
            f"{r['comm_s']['ep_all_to_all']:9.3g} {r['exposed_background_s']:9.3g} "
            f"{r.get('bubble_s', 0.0):9.3g}  "
            + (
                f"--parallel.pp={r['pp']} --parallel.pp_schedule={r['pp_schedule']} "
                + (
                    f"--parallel.pp_virtual_stages={r['pp_virtual_stages']} "
                    if r["pp_schedule"] == "Interleaved1F1B"
                    else ""
                )
                if r.get("pp", 1) > 1
                else ""
            )
            + f"--parallel.dp_replicate={r['dp_replicate']} --parallel.dp_shard={r['dp_shard']} "
            f"--parallel.cp={r['cp']} --parallel.ep={r['ep']} "
            + (f"--parallel.ep_overlap={r['ep_overlap']} " if r["ep"] > 1 else "")
            + f"--train.micro_batch_size={r['micro_batch_size']} "
            f"--train.activation_checkpoint={r['activation_checkpoint']}"
        )
    if not ranked:
        lines.append("  none fits: more ranks, or a smaller global batch or sequence")
    return lines
