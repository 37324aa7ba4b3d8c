"""The planner's report (`python -m moetrain.planner`): what a measured layout holds and moves
per rank (`report`, the JSON's figures), and its printed form (`format_report`)."""

from __future__ import annotations

from moetrain.planner.hardware import RESERVE_TEXT
from moetrain.planner.layout_cost import Layout, peak_bytes, rows_margin, step_bytes, update_bytes
from moetrain.planner.model_counts import CAUSAL_TILE
from moetrain.planner.objective_cost import (
    reference_compute_line,
    reference_memory_lines,
    reference_report,
)

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


def _count(n: int) -> str:
    """A parameter count, exact and, from a million on, in M or B: 671,026,522,112 (671.0B)."""
    if n < 1e6:
        return f"{n:,}"
    return f"{n:,} ({n / 1e9:.1f}B)" if n >= 1e9 else f"{n:,} ({n / 1e6:.1f}M)"


def parameters_line(n: dict) -> str:
    """`model_counts.parameter_counts`, printed: the main model apart from its MTP module,
    where it has one (published counts are the main model's)."""
    if "mtp" not in n:
        return (
            f"parameters: {_count(n['total'])} total, {_count(n['active'])} active per "
            "token (each routed expert at top_k / experts)"
        )
    main, mtp = n["main"], n["mtp"]
    return (
        f"parameters: main model {_count(main['total'])} total, {_count(main['active'])} "
        f"active per token (each routed expert at top_k / experts); MTP module "
        f"{_count(mtp['total'])} total, {_count(mtp['active'])} active; together "
        f"{_count(n['total'])}, {_count(n['active'])} active"
    )


def report(
    layout: Layout,
    gpu_memory: float | None,
    suggestions: list[tuple[str, int]],
    reserve_gib: float = 0.0,
) -> dict:
    """The figures of `layout`; `gpu_memory`: GiB the GPU exposes (--gpu-memory), of which
    `reserve_gib` is kept back for the CUDA context and NCCL buffers."""
    cfg, dims, s = layout.cfg, layout.dims, layout.state
    world = dims.world_size
    per_rank = [
        {
            "rank": r,
            "params": s.params[r],
            "grads": s.grads[r],
            "optimizer": s.optimizer[r],
            "frozen": s.frozen[r],
        }
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
        },
        "micro_batch": [cfg.train.micro_batch_size, cfg.data.seq_len],
        "activation_checkpoint": cfg.train.activation_checkpoint,
        "per_rank": per_rank,
        "fsdp_buffers": layout.fsdp_buffers,
        # the update (norm, clip, optimizer step): gradients and the step's temporaries
        "update_increase_rank0": update_bytes(layout),
        "modes": modes,
        "per_step": layout.comm,
        "peak": peak_bytes(layout, cfg.train.activation_checkpoint),
        "routing_imbalance": layout.routing_imbalance,
        "routing_imbalance_bytes": rows_margin(layout, cfg.train.activation_checkpoint),
    }
    if cfg.peft.method == "lora":
        out["frozen_base_dtype"] = cfg.peft.base_dtype
    objective = reference_report(layout)
    if objective is not None:
        out["objective"] = objective
    if pc is not None:
        out["layout"].update(pp=dims.pp, pp_schedule=pc.schedule)
        out["pipeline"] = {
            "schedule": pc.schedule,
            "micro_batches": pc.micro_batches,
            "stage_flops_share": pc.flops_share,
            "hidden_bytes": pc.hidden_bytes,
            "pp_ranks": [
                {
                    "stages": r.stages,
                    "p2p_bytes": r.p2p,
                    "step_buffers": r.step_buffers,
                    "activations": {m: a[i] for m, a in pc.activations.items()},
                    "inputs_in_flight": pc.in_flight[i],
                    "inputs_bytes": pc.in_flight[i] * pc.hidden_bytes,
                }
                for i, r in enumerate(pc.ranks)
            ],
        }
    c, ac = layout.comm, cfg.train.activation_checkpoint
    out["fsdp_gather"] = {
        "configured": layout.dims.fsdp_gather(cfg.parallel.fsdp_gather),  # auto resolved
        "micro_batch": {
            "all_gather": c["fsdp_all_gather"],
            "reduce_scatter": c["fsdp_reduce_scatter"],
            "peak": peak_bytes(layout, ac, gather="micro_batch"),
        },
        "step": {
            "all_gather": c["fsdp_all_gather_once"],
            "reduce_scatter": c["fsdp_reduce_scatter_once"],
            "peak": peak_bytes(layout, ac, gather="step"),
        },
    }
    if gpu_memory is not None:
        out["gpu_memory_gib"] = gpu_memory
        out["reserve_gib"] = reserve_gib
        out["usable_gib"] = gpu_memory - reserve_gib
        out["fits"] = out["peak"] <= out["usable_gib"] * GIB
        out["suggestions"] = [{"flag": flag, "peak": peak} for flag, peak in suggestions]
        out["fsdp_gather"]["pick"] = pick_fsdp_gather(
            out["fsdp_gather"], c, out["usable_gib"] * GIB
        )
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
    ]
    if "parameters" in r:  # the model's own size: the first check of a new model's config
        lines.append(parameters_line(r["parameters"]))
    lines += ["", f"{name} per rank   params    grads  optimizer"]
    rows = [f"{g(p['params'])} {g(p['grads'])} {g(p['optimizer'])}" for p in r["per_rank"]]
    for ranks, row in _ranges(rows):  # ranks whose figures print alike share a line
        lines.append(f"ranks {ranks:<8}{row}")
    if "frozen_base_dtype" in r:  # LoRA: how much of params is the base (peft.base_dtype)
        held = [f"{g(p['frozen']).strip()}" for p in r["per_rank"]]
        where = ", ".join(f"ranks {ranks} {v}" for ranks, v in _ranges(held))
        lines.append(
            f"(of the params, the frozen base in {r['frozen_base_dtype']}: {where} {name})"
        )
    lines += [
        "",
        "activation_checkpoint  activations  rank peak (+ FSDP buffers "
        f"{r['fsdp_buffers'] / unit:.2f} {name})",
    ]
    for mode, m in r["modes"].items():
        mark = "  <- configured" if mode == r["activation_checkpoint"] else ""
        lines.append(f"{mode:<22}{g(m['activation_peak'])}     {g(m['peak_rank0'])}{mark}")
    lines.append(
        f"(a rank peak is the higher of the forward/backward and the optimizer step, "
        f"which adds {r['update_increase_rank0'] / unit:.2f} {name}: gradients and "
        "its temporaries)"
    )
    if "objective" in r:  # what DPO's reference holds, in the peaks above
        lines += reference_memory_lines(r["objective"], unit, name)
    if r["routing_imbalance"] > 1:
        lines.append(
            f"(routing imbalance {r['routing_imbalance']:g}, --routing-imbalance: the busiest "
            f"expert-parallel rank takes {r['routing_imbalance'] - 1:.0%} more routed rows "
            f"than balanced routing; its saved rows add {_size(r['routing_imbalance_bytes'])} "
            "to the configured mode's peak)"
        )
    if pipe:
        lines.append("pp rank  stages     activations per mode (none/selective/full)   sends")
        for i, q in enumerate(pipe["pp_ranks"]):
            acts = "/".join(f"{a / unit:.2f}" for a in q["activations"].values())
            lines.append(
                f"{i:<8} {','.join(map(str, q['stages'])):<10} {acts:<44} "
                f"{q['p2p_bytes'] / unit:.2f} {name}"
            )
        lines.append(
            "(under pp, FSDP keeps a stage's units gathered and its gradients "
            "unsharded through the step, and gathers and reduces once per step: "
            "parallel.fsdp_gather does not apply)"
        )
        held = max(pipe["pp_ranks"], key=lambda q: q["inputs_bytes"])
        lines.append(
            f"(the activations include each stage's input for every micro-batch in flight: "
            f"up to {held['inputs_in_flight']} x {_size(pipe['hidden_bytes'])} = "
            f"{_size(held['inputs_bytes'])} on a pp rank)"
        )
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
    for mode, label in (
        () if pipe else (("micro_batch", "per micro-batch"), ("step", "once per step"))
    ):
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
        lines.append(
            f"\n--gpu-memory {r['gpu_memory_gib']:g} GiB as the GPU exposes it, less "
            f"{r['reserve_gib']:g} GiB kept back (--memory-reserve: {RESERVE_TEXT}): "
            f"{r['usable_gib']:.1f} GiB usable; peak {_size(r['peak'])}: {verdict}"
        )
        for s in r["suggestions"]:
            lines.append(f"  fits with {s['flag']} ({_size(s['peak'])})")
        if not r["fits"] and not r["suggestions"]:
            lines.append("  no single knob tried brings it in (see docs: Will it fit?)")
    return "\n".join(lines)


# --- the estimate's notes ------------------------------------------------------------------


def estimate_notes(estimate: dict, cfg, flops_per_token) -> list[str]:
    """What the printed estimate adds below its line: what the kernels execute of causal
    attention, what DPO's reference adds to the step (or its one-off pass), what
    `train.fp8` runs in FP8 and what its quantisation costs, and under pipeline stages the
    busiest rank's load and which schedule was modelled."""
    lines = []
    causal = getattr(flops_per_token, "causal", 1.0)
    if causal < 1:
        lines.append(
            f"(attention at {causal:.3f} of the full S x S product: the causal kernels skip "
            f"the {CAUSAL_TILE} x {CAUSAL_TILE} tiles above the diagonal and compute the "
            "diagonal ones whole; MFU's count takes the full product)"
        )
    lines += reference_compute_line(estimate)
    p = estimate["precision"]
    if p["fp8"] != "none":
        lines.append(
            f"(train.fp8={p['fp8']}: the blocks' GEMMs but the routers, "
            f"{p['fp8_flops_per_token'] / 1e9:,.1f} GFLOP a token of "
            f"{float(flops_per_token) / 1e9:,.1f}, at {p['fp8_tflops']:g} TFLOP/s and the "
            f"same efficiency, {p['fp8_s']:.3f} s of the compute with their inputs' "
            f"quantisation, {p['quantise_bytes'] / 1e12:,.2f} TB through memory: "
            f"{p['quantise_s']:.3f} s; the head, routers and attention in bf16)"
        )
    if "busiest_load" in estimate:
        schedule = cfg.parallel.pp_schedule
        line = (
            f"(pipeline {schedule}: span {estimate['pipeline_span_s']:.3f} s, bubble "
            f"{estimate['bubble_s']:.3f} s; the busiest pp rank computes "
            f"{estimate['busiest_load']:.2f}x the mean rank"
        )
        if schedule == "DualPipeV":
            line += (
                "; modelled as torch's DualPipeV, one V: rank 0 holds the first stage and the "
                "last, with the head and MTP. DeepSeek-V3 ran DualPipe, two pipelines in "
                "opposite directions over the same ranks, which spreads the ends over rank 0 "
                "and the last rank; it is not modelled, so a comparison with DeepSeek's "
                "1,543 tokens/s per GPU is against DualPipeV"
            )
        lines.append(line + ")")
    return lines
