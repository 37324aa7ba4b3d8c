"""Which layout is fastest? A step-time model over the planner's measured bytes and FLOPs
(`python -m trainer.dry_run ... --search`; docs/planner.md, "Step-time model").

The model, per rank and step (every figure it uses is printed with the estimate):

- compute: training FLOPs of the rank's tokens (the model's own `flops_per_token`, as MFU
  counts them; `full` checkpointing adds one forward: x4/3; `selective` recomputes
  element-wise regions, and MLA's up-projections, not counted yet) / (peak x efficiency);
  with measured rates (`--gemm-rates FILE`, the JSON of `benchmarks/gemm_rates.py`) the
  sum over kinds of kernel (dense GEMMs, grouped expert GEMMs, attention: the split the
  model's count carries, `models.common.flops.FlopsPerToken`) of each kind's FLOPs /
  (peak x that kind's measured efficiency), instead of one constant efficiency;
- each collective's bytes on the wire (ring algorithms: (n-1)/n of an all-gather or
  reduce-scatter, 2(n-1)/n of an all-reduce; the all-to-all's bytes already leave the
  rank) / the bandwidth of the link it crosses: inside a node while its group fits in one
  (groups are runs of consecutive ranks, `parallelisms.mesh`), else across nodes; an
  all-to-all over more ranks than a node splits its bytes between the two, and its
  two-stage dispatch (`parallelisms.node_dispatch`) sends one row per (token, remote node)
  across instead of one per (token, remote expert): `node_share` of them under uniform
  routing, the crossed rows fanning out again inside the node after they arrive (the
  stages' times add up);
- overlap as the trainer has it: FSDP's gathers and reductions are prefetched and run
  under compute, and so do the ring's transfers (posted before each block is computed), so
  only what exceeds the compute shows; of the expert all-to-all, what `parallel.ep_overlap`
  leaves in flight hides under the compute between its issue and its wait
  (`a2a_cost.a2a_hidden`, which states the rule): step = compute + all-to-all - hidden +
  max(0, background - compute).

Not modelled: element-wise work (norms, activations, the routing's permutations), host
synchronisations, routing imbalance (balanced routing, as the byte counts), latency of
small messages, and the optimizer step; without `--gemm-rates`, kernel efficiency by shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from parallelisms.dims import V_SCHEDULES, ep_fits_nodes
from trainer.dry_run.a2a_cost import GB, a2a_hidden, a2a_seconds, overlap_shares


@dataclass(frozen=True)
class Hardware:
    """One GPU and its node's links; the presets' figures are nominal per-GPU ones."""

    name: str
    tflops: float  # dense bf16 peak per GPU
    efficiency: float  # the fraction of that peak the kernels reach
    intra_gbps: float  # GB/s per GPU per direction inside a node (NVLink)
    inter_gbps: float  # GB/s per GPU per direction across nodes (one NIC per GPU)
    ranks_per_node: int
    memory_gib: float


PRESETS = {
    # 8 x H100 SXM: NVLink 4 (900 GB/s both ways), one 400 Gb/s NIC per GPU
    "h100": Hardware("8 x H100 SXM, NVLink 4, 8 x 400 Gb/s", 989, 0.5, 450, 50, 8, 80),
    # 8 x H200 SXM: the same compute and links, more memory
    "h200": Hardware("8 x H200 SXM, NVLink 4, 8 x 400 Gb/s", 989, 0.5, 450, 50, 8, 141),
    # DeepSeek-V3's cluster (its report): NVLink 400 GB/s both ways, 400 Gb/s InfiniBand
    "h800": Hardware("8 x H800, NVLink 400 GB/s, 8 x 400 Gb/s", 989, 0.5, 200, 50, 8, 80),
}


def hardware(preset: str, **overrides: float | None) -> Hardware:
    hw = PRESETS[preset]
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})


def _link(group: int, hw: Hardware) -> float:
    """GB/s of a group of `group` consecutive ranks' collectives."""
    return hw.intra_gbps if group <= hw.ranks_per_node else hw.inter_gbps


def read_rates(path: str) -> dict:
    """The measured efficiency of each kind of kernel from `benchmarks/gemm_rates.py`'s JSON:
    {"file", "model", "device", "peak_tflops", "efficiency": {kind: fraction of that peak}}."""
    from trainer.config import ConfigError

    try:
        with open(path) as f:
            data = json.load(f)
        kinds = data["categories"]
        efficiency = {k: float(v["efficiency"]) for k, v in kinds.items() if v.get("efficiency")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"--gemm-rates {path}: not the JSON of benchmarks/gemm_rates.py ({err!r})"
        ) from err
    if any(e <= 0 for e in efficiency.values()):
        raise ConfigError(f"--gemm-rates {path}: an efficiency <= 0: {efficiency}")
    peak = data.get("peak_tflops")
    return {"file": path, "model": data.get("model"), "device": data.get("device"),
            "peak_tflops": float(peak) if peak else None, "efficiency": efficiency}  # fmt: skip


def rates_by_kind(rates: dict, flops_per_token: float, hw: Hardware) -> dict:
    """kind -> (training FLOPs per token, efficiency against `hw.tflops`) for `estimate`.
    The file's efficiencies are fractions of the peak it was measured against: converted,
    so that each kind runs at the TFLOP/s measured whatever peak the planner assumes."""
    from trainer.config import ConfigError

    split = getattr(flops_per_token, "by_kind", None)
    if split is None:
        raise ConfigError("--gemm-rates: this model's flops_per_token gives no split by kind "
                          "(models.common.flops.FlopsPerToken)")  # fmt: skip
    scale = (rates["peak_tflops"] or hw.tflops) / hw.tflops
    missing = [k for k, f in split.items() if f and k not in rates["efficiency"]]
    if missing:
        raise ConfigError(f"--gemm-rates {rates['file']}: no efficiency for {', '.join(missing)}")
    return {k: (f, rates["efficiency"][k] * scale) for k, f in split.items() if f}


def efficiency_text(hw: Hardware, by_kind: dict | None, rates: dict | None) -> str:
    """Where the compute's efficiency came from, for the printed reports: the constant, or
    (with `by_kind` from `rates`) each kind's, the file, and what it measured on."""
    if by_kind is None:
        return f"{hw.tflops:g} TFLOP/s x {hw.efficiency:g}"
    effs = ", ".join(f"{k} {e:.3g}" for k, (_, e) in by_kind.items())
    what = [rates["model"] or "", f"on {rates['device']}" if rates["device"] else ""]
    where = ", ".join([rates["file"], " ".join(w for w in what if w)]).rstrip(", ")
    return f"{hw.tflops:g} TFLOP/s x measured efficiency ({effs}: {where})"


def estimate(
    layout,
    mode: str,
    flops_per_token: float,
    hw: Hardware,
    by_kind: dict | None = None,
    overlap: str | None = None,
) -> dict:
    """Step time of `layout` (a `layout_cost.Layout`) under checkpointing `mode`; with
    `by_kind` (`rates_by_kind`), the compute from each kind's FLOPs and measured efficiency
    instead of the whole count at `hw.efficiency`; `overlap`: parallel.ep_overlap (None:
    the layout's)."""
    cfg, dims, comm = layout.cfg, layout.dims, layout.comm
    tokens = cfg.train.global_batch_size * cfg.data.seq_len  # per step, all ranks
    replay = 4 / 3 if mode == "full" else 1.0
    flops = flops_per_token * tokens / dims.world_size * replay
    by_kind_s = None
    if by_kind is None:
        compute_s = flops / (hw.tflops * 1e12 * hw.efficiency)
    else:
        by_kind_s = {k: f * tokens / dims.world_size * replay / (hw.tflops * 1e12 * e)
                     for k, (f, e) in by_kind.items()}  # fmt: skip
        compute_s = sum(by_kind_s.values())
    fsdp_n = dims.dp_shard * dims.cp
    ring_f = (fsdp_n - 1) / fsdp_n
    gather = comm[
        "fsdp_all_gather_once" if cfg.parallel.fsdp_gather == "step" else "fsdp_all_gather"
    ]
    scatter = comm["fsdp_reduce_scatter_once" if cfg.parallel.fsdp_gather == "step" else "fsdp_reduce_scatter"]  # fmt: skip
    seconds = {
        "fsdp": (gather + scatter) * ring_f / (_link(fsdp_n, hw) * GB),
        # replicas are fsdp_n ranks apart: across nodes once a shard group fills a node
        "hsdp": comm["hsdp_all_reduce"] * 2 * (dims.dp_replicate - 1) / dims.dp_replicate
        / (_link(fsdp_n * dims.dp_replicate, hw) * GB),
        "cp_ring": comm["cp_ring_full_ac" if mode == "full" else "cp_ring"] / (_link(dims.cp, hw) * GB),
    }  # fmt: skip
    a2a = comm["ep_all_to_all_full_ac" if mode == "full" else "ep_all_to_all"]
    seconds["ep_all_to_all"], share = a2a_seconds(a2a, layout, hw)
    background = seconds["fsdp"] + seconds["hsdp"] + seconds["cp_ring"]
    # the shares of the compute under which a MoE layer's all-to-all may run
    hides, form = overlap_shares(flops_per_token, by_kind_s), overlap or cfg.parallel.ep_overlap
    if layout.pipeline is not None:
        from trainer.dry_run.pipeline_cost import pipeline_step

        step_s, extra = pipeline_step(layout, mode, compute_s, seconds, hw, hides, form)
        return {"flops_per_rank": flops, "compute_s": extra.pop("compute_s"), "comm_s": seconds,
                "node_share": share, "experts": layout.experts, "top_k": layout.top_k,
                "step_s": step_s, "tokens_per_s": tokens / step_s, **extra}  # fmt: skip
    forwards = 2 if mode == "full" else 1  # the replay's forward moves its tokens again
    pass_s = seconds["ep_all_to_all"] / (forwards + 1)
    experts_s, shared_s = (compute_s / (forwards + 2) * h for h in hides)  # in one forward
    hidden = forwards * a2a_hidden(form, pass_s, experts_s, shared_s)
    hidden += a2a_hidden(form, pass_s, 2 * experts_s, 2 * shared_s)  # backward: twice
    step_s = compute_s + seconds["ep_all_to_all"] - hidden + max(0.0, background - compute_s)
    out = {
        "flops_per_rank": flops,
        "compute_s": compute_s,
        "comm_s": seconds,
        "ep_hidden_s": hidden,  # of comm_s["ep_all_to_all"], what runs under compute
        "exposed_background_s": max(0.0, background - compute_s),
        "node_share": share,  # of the remote all-to-all rows, what crosses nodes
        "experts": layout.experts,
        "top_k": layout.top_k,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
    }
    if by_kind_s is not None:
        out["compute_by_kind_s"] = by_kind_s
    return out


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
    from parallelisms.dims import pipeline_micro_batches_needed

    node = hw.ranks_per_node
    out = []
    for pp in (1, 2, 4, 8, 16):
        stage_world = world_size // pp
        if world_size % pp or (pp > 1 and blocks < pp):
            continue
        schedules = [(s, v) for s, v in SEARCH_SCHEDULES if blocks >= pp * v] if pp > 1 else [("1F1B", 1)]  # fmt: skip
        # NOTE: with pipeline stages, plain FSDP inside each and no ring: the search stays
        # within its time (each stage cut and degree is measured afresh), and both are
        # there to cut memory, which stages already divide.
        replicas = {1} | ({stage_world // node} if pp == 1 and stage_world > node and stage_world % node == 0 else set())  # fmt: skip
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
                            out.append({"parallel": {"dp_replicate": rep, "dp_shard": shard_world // cp,
                                                     "cp": cp, "ep": ep, **staged},
                                        "train": {"micro_batch_size": mb}})  # fmt: skip
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
) -> list[dict]:
    """Every candidate x checkpointing mode that fits `budget` bytes, fastest first (`by_kind`:
    measured efficiencies, as `estimate` takes them; `reuse`: a `layout_cost.Measured` to
    share with earlier measurements of this model; `workers`: processes that measure
    meanwhile, None: `workers.auto_workers`, 0: none)."""
    import copy

    from trainer.config import ConfigError
    from trainer.dry_run.layout_cost import Measured, measure_state
    from trainer.dry_run.workers import SearchPool, auto_workers, search_jobs

    flops = flops_per_token(cfg)
    tried = candidates(cfg, world_size, hw, _trunk_blocks(cfg))
    trials = []
    for cand in tried:
        trial = copy.deepcopy(cfg)
        for section, values in cand.items():
            for key, value in values.items():
                setattr(getattr(trial, section), key, value)
        trials.append(trial)
    # Candidates share shardings (all micro-batch sizes) and traces (every degree but cp):
    # each is measured once (layout_cost.Measured), most in worker processes while this
    # one shards the pipeline stages (trainer.dry_run.workers).
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
        return _rank(tried, trials, world_size, hw, budget, log, by_kind, reuse, flops)
    finally:
        if pool is not None:
            pool.close()


def _rank(tried, trials, world_size, hw, budget, log, by_kind, reuse, flops) -> list[dict]:
    from trainer.config import ConfigError
    from trainer.dry_run.layout_cost import MODES, measure_layout, peak_bytes

    ranked = []
    for i, (cand, trial) in enumerate(zip(tried, trials, strict=True), start=1):
        try:
            layout = measure_layout(trial, world_size, reuse=reuse)
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
            ranked.append({**cand["parallel"], "micro_batch_size": cand["train"]["micro_batch_size"],
                           "activation_checkpoint": mode, "ep_overlap": form, "peak": peak,
                           "comm_bytes": layout.comm, **est})  # fmt: skip
        log(
            f"  [{i}/{len(tried)}] measured {cand['parallel']}, micro-batch {cand['train']['micro_batch_size']}"
        )
    ranked.sort(key=lambda r: -r["tokens_per_s"])
    return ranked


def _trunk_blocks(cfg) -> int:
    """The blocks pipeline stages are cut from (parallelisms.pipeline_split)."""
    import torch

    from models import get_model_spec
    from parallelisms.pipeline_split import trunk_blocks

    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        return len(trunk_blocks(spec.build(cfg.model.args), spec.plan))


def flops_per_token(cfg) -> float:
    """Training FLOPs per token of the config's model (the model's own count, as MFU's; its
    split by kind of kernel, where the model gives one, in `.by_kind`)."""
    import torch

    from models import get_model_spec

    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        return spec.flops_per_token(spec.build(cfg.model.args), cfg.data.seq_len)


def format_ranked(
    ranked: list[dict], hw: Hardware, top: int = 10, efficiency: str = ""
) -> list[str]:
    """`efficiency`: `efficiency_text`'s words (default: the constant's)."""
    efficiency = efficiency or efficiency_text(hw, None, None)
    lines = [f"fastest layouts that fit ({hw.name}: {efficiency}, "
             f"{hw.intra_gbps:g} GB/s in a node, {hw.inter_gbps:g} GB/s across, "
             f"{hw.ranks_per_node} per node):",
             "      tok/s     step s   compute       a2a   exposed    bubble  layout"]  # fmt: skip
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


def describe(hw: Hardware) -> dict:
    return asdict(hw)
