"""Pipeline stages in the planner (`parallel.pp` > 1): what each pp rank holds, the
activations its schedule keeps in flight, the point-to-point bytes, and a step's time with
its bubble (`trainer.dry_run.layout_cost` measures, `trainer.dry_run.search` estimates).

- State: the trainer's own cut (`trainer.loop.setup.pipeline_cut`); each stage pruned from
  the meta model and sharded by the real plan (`parallelize(..., stage=True)`) over the
  fake process group. A pp rank holds the sum of its stages. Stages with the same blocks,
  the same ends (embedding, head) and the same degrees are measured once.
- FSDP inside a stage: torch's schedules run every backward but the last without gradient
  sync, and a stage keeps its units gathered (`stage=True`). So every unit's gathered
  parameters and unsharded fp32 gradients live through the step, and each unit is
  gathered once and reduced once per step.
- Activations: a stage holds what its blocks save per micro-batch (the whole model's
  trace, per block structure; the last stage also what the head and the loss save), once
  per micro-batch it holds, counted along its rank's actions in torch's own order
  (`schedule_order`): from the forward to the backward (split backward: to the weight
  backward, which still reads the layers' inputs). On top, one micro-batch's backward
  transient, the whole model's (an upper bound for stages without the head).
- P2P: each stage boundary between two ranks carries every micro-batch's hidden states
  forward and their gradient back (one shape, in the compute dtype).
- Time (`simulate`): every rank's actions replayed in order. An action starts when its
  rank is free and its input is in: a forward after the previous stage's forward, a
  backward after the next stage's, plus a send's time between two ranks. A forward takes
  a third of the stage's training compute, the backward two thirds (the zero-bubble
  schedules split it evenly into input and weight backward; `full` checkpointing's replay
  adds a third to the input backward). The stage's share of the expert all-to-all runs in
  its forward and input backward, not overlapped (as without pp); the ring's transfers
  run under the compute. The step is the last action's end plus the FSDP traffic compute
  does not hide: the gathers beyond the first forward, the reduction after the last
  backward. The bubble is the busiest rank's idle time.
"""

from __future__ import annotations

from dataclasses import dataclass

# An action: (kind, stage, micro-batch) with kind F (forward), B (full backward), I (input
# backward), W (weight backward); or ("FB", (forward action, backward action)): DualPipeV
# running a forward and a backward of two chunks as one.
Action = tuple


@dataclass
class RankStages:
    """One pp rank: its stages and what they hold, per rank of one stage group."""

    stages: list[int]
    state: object  # footprint.ShardedState, stage_ranks long
    step_buffers: int  # every unit's gathered parameters and unsharded fp32 gradients
    gathered: int  # the all-gather outputs of a step (each unit once)
    reduced: int  # the reduce-scatter inputs of a step (each unit once)
    p2p: int  # bytes this rank sends per step


@dataclass
class PipelineCost:
    schedule: str
    pp: int
    micro_batches: int
    rank_of: list[int]  # stage -> pp rank
    flops_share: list[float]  # stage -> its part of the model's training FLOPs
    moe_share: list[float]  # stage -> its part of the MoE layers (the all-to-all)
    core_share: list[float]  # stage -> its part of the attention cores (the ring)
    saved: dict  # mode -> stage -> bytes one micro-batch leaves for the backward
    transient: dict  # mode -> one micro-batch's backward working bytes above that
    activations: dict  # mode -> pp rank -> activation bytes at the rank's peak
    hidden_bytes: int  # one micro-batch's hidden states at a stage boundary
    ranks: list[RankStages]
    order: dict  # pp rank -> its actions

    def rank(self, global_rank: int, stage_ranks: int) -> RankStages:
        return self.ranks[global_rank // stage_ranks]


def schedule_order(schedule: str, pp: int, virtual: int, micro_batches: int) -> dict:
    """pp rank -> its compute actions, in the order torch's schedule runs them (built over
    placeholder stages on a group of the fake process group: only the order is read)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from parallelisms.dims import stage_rank, stages_per_rank
    from parallelisms.pipeline import SCHEDULE_CLASSES

    if schedule == "1F1B":
        return {r: _one_f_one_b(r, pp, micro_batches) for r in range(pp)}
    num_stages = pp * stages_per_rank(schedule, virtual)
    group = dist.new_group(list(range(pp)))
    x = torch.empty(1, 1, device="meta")
    stages = [
        PipelineStage(nn.Identity(), s, num_stages, torch.device("cpu"), x, x, group=group)
        for s in range(num_stages)
        if stage_rank(s, pp, schedule) == 0
    ]
    built = SCHEDULE_CLASSES[schedule](stages, micro_batches, scale_grads=False)
    computes = ("F", "B", "I", "W", "OVERLAP_F_B")
    return {
        r: [_plain(a) for a in acts if a is not None and a.computation_type.value in computes]
        for r, acts in built.pipeline_order.items()
    }


def _one_f_one_b(rank: int, pp: int, n: int) -> list[Action]:
    """Schedule1F1B's order as its runtime runs it (its `_get_pipeline_order`, a display
    aid, numbers later ranks' micro-batches from 1): min(n, pp - rank) forwards, then a
    backward and a forward in turn, then the backwards left."""
    warmup = min(n, pp - rank)
    out: list[Action] = [("F", rank, m) for m in range(warmup)]
    for m in range(n):
        out.append(("B", rank, m))
        if warmup + m < n:
            out.append(("F", rank, warmup + m))
    return out


def _plain(action) -> Action:
    if action.sub_actions:
        return ("FB", tuple(_plain(a) for a in action.sub_actions))
    return (action.computation_type.value, action.stage_index, action.microbatch_index)


def _steps(action: Action) -> tuple:
    return action[1] if action[0] == "FB" else (action,)


def held_peak(actions: list[Action], saved: list[float]) -> float:
    """The most activation bytes a rank's actions hold at once: a micro-batch's stage
    saves `saved[stage]` at its forward and frees it at its full or weight backward."""
    held = peak = 0.0
    for action in actions:
        for kind, stage, _ in _steps(action):
            if kind == "F":
                held += saved[stage]
                peak = max(peak, held)
            elif kind in ("B", "W"):
                held -= saved[stage]
    return peak


def simulate(
    order: dict, rank_of: list[int], durations: dict[str, list[float]], p2p_s: float
) -> tuple[float, list[float]]:
    """(the step's span, each pp rank's busy time): every rank runs its actions in order,
    each as soon as the rank is free and its input has arrived. `durations`: kind ->
    stage -> seconds; `p2p_s`: one send between two ranks."""
    last = len(rank_of) - 1
    done: dict[tuple, float] = {}  # (kind, stage, mb) -> end; ("G", s, mb): input grad out

    def hop(frm: int, to: int) -> float:
        return p2p_s if rank_of[frm] != rank_of[to] else 0.0

    def ready(kind: str, s: int, m: int) -> float | None:
        if kind == "F":
            if s == 0:
                return 0.0
            t = done.get(("F", s - 1, m))
            return None if t is None else t + hop(s - 1, s)
        if kind == "W":
            return done.get(("I", s, m))
        t = done.get(("F", s, m))  # B or I
        if t is None or s == last:
            return t
        g = done.get(("G", s + 1, m))
        return None if g is None else max(t, g + hop(s + 1, s))

    ranks = sorted(order)
    at, free, busy = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0.0)
    left = sum(len(a) for a in order.values())
    while left:
        moved = False
        for r in ranks:
            actions = order[r]
            while at[r] < len(actions):
                steps = _steps(actions[at[r]])
                times = [ready(*s) for s in steps]
                if any(t is None for t in times):
                    break
                took = sum(durations[kind][s] for kind, s, _ in steps)
                end = max(free[r], *times) + took
                for kind, s, m in steps:
                    done[(kind, s, m)] = end
                    if kind in ("B", "I"):
                        done[("G", s, m)] = end
                free[r], busy[r] = end, busy[r] + took
                at[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("the pipeline order waits on itself (a torch schedule changed?)")
    return max(free.values()), [busy[r] for r in ranks]


def measure_pipeline(cfg, spec, dims, traces: dict, reuse) -> PipelineCost:
    """The pipeline part of `layout_cost.measure_layout`; `traces`: mode -> the whole
    model's StepTrace at this layout's local shapes; `reuse`: layout_cost.Measured."""
    import torch

    from parallelisms.dims import stage_rank
    from parallelisms.pipeline_build import example_inputs
    from parallelisms.pipeline_split import stage_costs, trunk_blocks
    from parallelisms.plan import match_modules
    from trainer.dry_run.footprint import block_structure
    from trainer.dry_run.layout_cost import _param_dtype
    from trainer.loop.peft import apply_lora
    from trainer.loop.setup import pipeline_cut

    p, plan = cfg.parallel, spec.plan
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
        if cfg.peft.method == "lora":
            apply_lora(model, plan, cfg.peft, cfg.model.name)
    cut = pipeline_cut(cfg, spec, model)
    n = dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    key = (p.pp_schedule, p.pp, p.pp_virtual_stages, n)
    if key not in reuse.orders:
        reuse.orders[key] = schedule_order(*key)
    order = reuse.orders[key]
    S = cut.num_stages
    rank_of = [stage_rank(s, p.pp, p.pp_schedule) for s in range(S)]

    # per stage: FLOPs, MoE layers, attention cores, saved bytes
    trunk = dict(trunk_blocks(model, plan))
    heads = [f for f, _ in match_modules(model, plan.head, "head", required=False)]

    def count(pattern, what: str, inside: list[str]) -> int:
        if pattern is None:
            return 0
        found = [f for f, _ in match_modules(model, pattern, what, required=False)]
        return sum(1 for f in found if any(f == i or f.startswith(i + ".") for i in inside))

    def parts(s: int) -> list[str]:
        return cut.blocks[s] + (heads if s == S - 1 else [])

    attention = spec.flops_per_token(model, cfg.data.seq_len).by_kind["attention"]
    costs = stage_costs(model, plan, attention)
    block_flops = dict(zip(trunk, costs.blocks, strict=True))
    flops = [sum(block_flops[f] for f in cut.blocks[s]) for s in range(S)]
    flops[-1] += costs.last
    moe = [count(plan.routed_experts, "routed_experts", parts(s)) for s in range(S)]
    cores = [count(plan.attention_core, "attention_core", parts(s)) for s in range(S)]
    saved, transient, activations = {}, {}, {}
    for mode, trace in traces.items():
        per = [sum(trace.saved_by_structure.get(block_structure(trunk[f]), 0.0) for f in cut.blocks[s]) for s in range(S)]  # fmt: skip
        per[-1] += max(0.0, trace.saved_after_forward - sum(per))  # the head, MTP, loss
        saved[mode] = per
        transient[mode] = max(0, trace.activations - trace.saved_after_forward)
        activations[mode] = [int(held_peak(order[r], per)) + transient[mode] for r in range(p.pp)]

    dtype = _param_dtype(cfg)
    _, h, _ = example_inputs(model, cfg.train.micro_batch_size, cfg.data.seq_len // dims.cp, dtype)
    hidden = h.numel() * h.element_size()
    ranks = []
    for r in range(p.pp):
        local = cut.local(r)
        parts_r = [_stage_shard(cfg, spec, model, cut, s, dims, reuse) for s in local]
        sends = sum((s < S - 1 and rank_of[s + 1] != r) + (s > 0 and rank_of[s - 1] != r) for s in local)  # fmt: skip
        ranks.append(
            RankStages(
                local,
                _sum_states([q[0] for q in parts_r]),
                sum(q[1] for q in parts_r),
                sum(q[2] for q in parts_r),
                sum(q[3] for q in parts_r),
                sends * n * hidden,
            )
        )
    total = lambda xs: max(sum(xs), 1)  # noqa: E731
    return PipelineCost(
        p.pp_schedule, p.pp, n, rank_of,
        [f / total(flops) for f in flops], [m / total(moe) for m in moe],
        [c / total(cores) for c in cores], saved, transient, activations, hidden, ranks, order,
    )  # fmt: skip


def _sum_states(states: list):
    from trainer.dry_run.footprint import ShardedState

    return ShardedState(
        *(
            [sum(col) for col in zip(*(getattr(s, f) for s in states), strict=True)]
            for f in ("params", "grads", "optimizer", "update")
        )
    )


def _stage_shard(cfg, spec, model, cut, index: int, dims, reuse) -> tuple:
    """(sharded state, step buffers, gathered, reduced bytes) of stage `index`, measured
    once per (degrees, blocks, ends)."""
    from dataclasses import asdict

    from parallelisms.parallelize import parallelize
    from parallelisms.pipeline_build import stage_module
    from trainer.dry_run.footprint import block_structure, sample_blocks
    from trainer.dry_run.layout_cost import _param_dtype, sharded_model

    S = cut.num_stages
    first, last = index == 0, index == S - 1
    pipeline_keys = ("pp", "pp_schedule", "pp_virtual_stages", "pp_layers")
    degrees = {k: v for k, v in asdict(cfg.parallel).items() if k not in pipeline_keys}
    degrees.update(dp_shard=dims.fsdp_size, cp=0, stage_ranks=dims.stage_ranks)
    structure = tuple(block_structure(model.get_submodule(f)) for f in cut.blocks[index])
    key = repr((sorted(degrees.items()), structure, first, last, last and cut.embedding_on_last))
    if key in reuse.stages:
        return reuse.stages[key]
    param_dtype = _param_dtype(cfg)
    stage = stage_module(model, spec.plan, cut, index)
    sampled = sample_blocks(stage, spec.plan)
    parallelize(stage, spec.plan, reuse.meshes_of(dims), param_dtype, cp_zigzag=True, stage=True)
    state, units = sharded_model(
        stage, spec.plan, cfg.train, param_dtype, sampled, dims.stage_ranks
    )
    gathered = int(sum(u.gathered * u.weight for u in units))
    reduced = int(sum(u.grads * u.weight for u in units))
    reuse.stages[key] = (state, gathered + reduced, gathered, reduced)
    return reuse.stages[key]


def pipeline_step(layout, mode: str, compute_s: float, seconds: dict, hw) -> tuple[float, dict]:
    """(step seconds, what else the estimate reports) of a layout with pipeline stages.
    `compute_s`: the training compute of a rank's share of the step as if the ranks were
    one stage group each (search.estimate's, replay included); `seconds`: its collective
    times (FSDP's are once per step here)."""
    from trainer.dry_run.search import GB, _link, a2a_seconds

    pc, dims = layout.pipeline, layout.dims
    trace = layout.activations[mode]
    n, full = pc.micro_batches, mode == "full"
    replay = 4 / 3 if full else 1.0
    # one micro-batch through the whole model, on one rank of a stage group
    third = compute_s / replay * dims.pp / n / 3
    pair = trace.routed * (dims.ep - 1) / dims.ep * 2  # dispatch + combine, all MoE layers
    a2a_pass = a2a_seconds(pair, layout, hw)[0]
    cp, link = dims.cp, _link(dims.cp, hw) * GB
    ring_fwd = trace.kv * (cp - 1) / link if cp > 1 else 0.0
    ring_bwd = ring_fwd + trace.kv_fp32 * cp / link if cp > 1 else 0.0
    durations: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}
    for phi, mu, core in zip(pc.flops_share, pc.moe_share, pc.core_share, strict=True):
        f = max(phi * third, core * ring_fwd) + mu * a2a_pass
        i = max(phi * third * (2 if full else 1), core * (ring_bwd + (ring_fwd if full else 0)))
        i += mu * a2a_pass * (2 if full else 1)
        w = phi * third
        durations["F"].append(f)
        durations["I"].append(i)
        durations["W"].append(w)
        durations["B"].append(i + w)
    # pp neighbours are a stage group apart: in one node only if the whole job is
    p2p_s = pc.hidden_bytes / (_link(dims.world_size, hw) * GB)
    span, busy = simulate(pc.order, pc.rank_of, durations, p2p_s)
    fsdp_n = dims.fsdp_size
    ring_f = (fsdp_n - 1) / fsdp_n / (_link(fsdp_n, hw) * GB)
    gather_s = layout.comm["fsdp_all_gather"] * ring_f
    reduce_s = layout.comm["fsdp_reduce_scatter"] * ring_f
    # NOTE: FSDP's prefetch hides the gathers under the first forward of rank 0 (the first
    # stage); the reduction follows the last backward, and HSDP's all-reduce follows it.
    exposed = max(0.0, gather_s - durations["F"][0]) + reduce_s + seconds["hsdp"]
    busiest = max(range(dims.pp), key=lambda r: busy[r])
    mine = pc.ranks[busiest].stages
    return span + exposed, {
        "compute_s": sum(pc.flops_share[s] for s in mine) * third * (3 + (1 if full else 0)) * n,
        "exposed_background_s": exposed,
        "pipeline_span_s": span,
        "bubble_s": span - busy[busiest],
        "bubble": (span - busy[busiest]) / span,
        "p2p_s": p2p_s,
        "p2p_bytes": layout.comm["pp_p2p"],
    }
