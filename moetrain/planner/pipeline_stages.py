"""Pipeline stages in the planner (`parallel.pp` > 1), measured: what each pp rank holds,
the activations its schedule keeps in flight, the point-to-point bytes
(`moetrain.planner.layout_cost` measures a layout with them; its step's time with the
bubble: `moetrain.planner.pipeline_cost`).

- State: the trainer's own cut (`moetrain.build.model.pipeline_cut`); a stage's shards are
  the sum of its pieces' (each trunk block, the embedding on the first stage, the head on
  the last), each piece pruned from the meta model into a stage of its own and sharded by
  the real plan (`parallelize(..., stage=True)`) over the fake process group, once per set
  of degrees. A pp rank holds the sum of its stages.
- FSDP inside a stage: torch's schedules run every backward but the last without gradient
  sync, and a stage keeps its units gathered (`stage=True`). So every unit's gathered
  parameters and unsharded fp32 gradients live through the step, and each unit is
  gathered once and reduced once per step.
- Activations: a stage holds what its blocks save per micro-batch (the whole model's
  trace, per block structure; the last stage also what the head and the loss save), once
  per micro-batch it holds, counted along its rank's actions in torch's own order
  (`moetrain.planner.pipeline_schedule`): from the forward to the backward (split
  backward: to the weight backward, which still reads the layers' inputs). On top, one micro-batch's backward
  transient, the whole model's (an upper bound for stages without the head).
- P2P: each stage boundary between two ranks carries every micro-batch's hidden states
  forward and their gradient back (one shape, in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.planner.pipeline_schedule import held_peak, schedule_order
from moetrain.planner.shards import param_dtype, shard_key, sharded_model


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
    # stage -> its part of the FP8 GEMMs' FLOPs (train.fp8), and of the others'
    fp8_share: list[float]
    rest_share: list[float]
    moe_share: list[float]  # stage -> its part of the MoE layers (the all-to-all)
    core_share: list[float]  # stage -> its part of the attention cores (the ring)
    saved: dict  # mode -> stage -> bytes one micro-batch leaves for the backward
    transient: dict  # mode -> one micro-batch's backward working bytes above that
    activations: dict  # mode -> pp rank -> activation bytes at the rank's peak
    hidden_bytes: int  # one micro-batch's hidden states at a stage boundary
    ranks: list[RankStages]
    order: dict  # pp rank -> its actions
    # stage -> its part of what `selective` computes again (recompute_cost; none measured: 0)
    recompute_share: list[float] = None
    # mode -> pp rank -> of `activations`, what the routing imbalance adds
    imbalance_bytes: dict = None
    in_flight: list[int] = None  # pp rank -> the most micro-batch stages it holds at once


@dataclass
class _Cut:
    """What a layout's cut gives, whatever its micro-batch and degrees."""

    model: object  # the whole meta model
    cut: object  # moetrain.parallelisms.pipeline_build.PipelineCut
    structures: list  # stage -> its trunk blocks' structures
    flops: list  # stage -> its training FLOPs per token (as executed)
    fp8_flops: list  # stage -> of them, the GEMMs train.fp8 runs in FP8
    moe: list  # stage -> its MoE layers
    cores: list  # stage -> its attention cores


def _cut_of(cfg, spec, reuse) -> _Cut:
    """The cut of the config's model for its [parallel] section, once per search."""

    from moetrain.build.model import meta_model, pipeline_cut
    from moetrain.parallelisms.pipeline_split import stage_costs, trunk_blocks
    from moetrain.parallelisms.plan import match_modules
    from moetrain.planner.activation_trace import block_structure
    from moetrain.planner.model_counts import executed, fp8_flops_of, fp32_modules

    p, plan = cfg.parallel, spec.plan
    key = _cut_key(p)
    if key in reuse.cuts:
        return reuse.cuts[key]
    model = reuse.cuts.get("model")
    if model is None:
        model = meta_model(spec, cfg.model.args, cfg.peft, hold_base=True)
        reuse.cuts["model"] = model
    cut = pipeline_cut(cfg, spec, model)
    S = cut.num_stages
    trunk = dict(trunk_blocks(model, plan))
    heads = [f for f, _ in match_modules(model, plan.head, "head", required=False)]

    def counts(pattern, what: str) -> list[int]:  # stage -> its modules matching `pattern`
        if pattern is None:
            return [0] * S
        found = [f for f, _ in match_modules(model, pattern, what, required=False)]
        inside = [cut.blocks[s] + (heads if s == S - 1 else []) for s in range(S)]
        within = lambda f, ins: any(f == i or f.startswith(i + ".") for i in ins)  # noqa: E731
        return [sum(within(f, ins) for f in found) for ins in inside]

    total = executed(spec.flops_per_token(model, cfg.data.seq_len), model, plan, cfg.data.seq_len)
    costs = stage_costs(model, plan, total.by_kind["attention"], total)
    block_flops = dict(zip(trunk, costs.blocks, strict=True))
    flops = [sum(block_flops[f] for f in cut.blocks[s]) for s in range(S)]
    flops[-1] += costs.last
    routers = fp32_modules(model, plan)
    fp8 = [sum(fp8_flops_of(trunk[f], routers) for f in cut.blocks[s]) for s in range(S)]
    fp8[-1] += total.gemms.fp8_flops - sum(fp8)  # the MTP depths' blocks
    reuse.cuts[key] = _Cut(
        model,
        cut,
        [[block_structure(trunk[f]) for f in cut.blocks[s]] for s in range(S)],
        flops,
        fp8,
        counts(plan.routed_experts, "routed_experts"),
        counts(plan.attention_core, "attention_core"),
    )
    return reuse.cuts[key]


def _cut_key(p) -> tuple:
    """What a cut depends on: the [parallel] section's pipeline values."""
    return (p.pp, p.pp_schedule, p.pp_virtual_stages, tuple(p.pp_layers or ()))


def measure_pipeline(
    cfg, spec, dims, traces: dict, reuse, routing_imbalance: float = 1.0
) -> PipelineCost:
    """The pipeline part of `layout_cost.measure_layout`; `traces`: mode -> the whole
    model's StepTrace at this layout's local shapes; `reuse`: shards.Measured;
    `routing_imbalance`: the busiest rank's routed rows over the mean (its saved rows
    grow by as much)."""
    from moetrain.parallelisms.dims import stage_rank
    from moetrain.parallelisms.pipeline_build import example_inputs

    p = cfg.parallel
    c, order_key = stage_states(cfg, spec, dims, reuse)
    cut, S, n = c.cut, c.cut.num_stages, order_key[-1]
    order = reuse.orders[order_key]
    rank_of = [stage_rank(s, p.pp, p.pp_schedule) for s in range(S)]
    seq = cfg.data.seq_len // dims.cp
    _, h, _ = example_inputs(c.model, cfg.train.micro_batch_size, seq, param_dtype(cfg))
    hidden = h.numel() * h.element_size()
    saved, transient, activations, margin = {}, {}, {}, {}
    for mode, trace in traces.items():
        per = stage_saved(trace, c.structures, hidden, routing_imbalance)
        even = stage_saved(trace, c.structures, hidden)
        saved[mode] = per
        transient[mode] = max(0, trace.activations - trace.saved_after_forward)
        held = [int(_held(reuse, order_key, r, per, cut)) for r in range(p.pp)]
        activations[mode] = [h + transient[mode] for h in held]
        margin[mode] = [h - int(_held(reuse, order_key, r, even, cut)) for r, h in enumerate(held)]
    ranks = []
    for r in range(p.pp):
        local = cut.local(r)
        key = ("rank", repr(dims), _cut_key(p), r)  # its stages' shards, summed once
        if key not in reuse.stages:
            parts_r = [_stage_shard(cfg, spec, c, s, dims, reuse) for s in local]
            reuse.stages[key] = (
                _sum_states([(q[0], 1) for q in parts_r]),
                *(sum(q[i] for q in parts_r) for i in (1, 2, 3)),
            )
        sends = sum(
            (s < S - 1 and rank_of[s + 1] != r) + (s > 0 and rank_of[s - 1] != r) for s in local
        )
        ranks.append(RankStages(local, *reuse.stages[key], sends * n * hidden))
    total = lambda xs: max(sum(xs), 1)  # noqa: E731
    return PipelineCost(
        p.pp_schedule,
        p.pp,
        n,
        rank_of,
        [f / total(c.flops) for f in c.flops],
        [f / total(c.fp8_flops) for f in c.fp8_flops],
        [
            (f - g) / total([a - b for a, b in zip(c.flops, c.fp8_flops, strict=True)])
            for f, g in zip(c.flops, c.fp8_flops, strict=True)
        ],
        [m / total(c.moe) for m in c.moe],
        [x / total(c.cores) for x in c.cores],
        saved,
        transient,
        activations,
        hidden,
        ranks,
        order,
        _recompute_share(traces, c.structures),
        margin,
        [int(held_peak(order[r], [1.0] * S)) for r in range(p.pp)],
    )


def stage_saved(trace, structures: list, hidden: int, imbalance: float = 1.0) -> list[float]:
    """stage -> the bytes one micro-batch leaves on it for the backward: its blocks' (by
    structure, from the whole model's `trace`), its input, and on the last stage the rest
    (the head, MTP, the loss). `hidden`: one micro-batch's hidden states at a boundary;
    `imbalance`: the factor on the blocks' routed rows (the busiest expert-parallel rank).

    NOTE: a stage holds its input for every micro-batch in flight until that micro-batch's
    backward (torch's PipelineStage keeps the received activations for their gradient):
    the blocks' bytes count what they create, and in the whole model's trace a block's input
    is its predecessor's output, or the embedding's, which the rest would put on the last
    stage. So every stage gets one `hidden` a micro-batch (the first stage's is the
    embedding's output, taken off the rest): DeepSeek-V3's published layout, 33 micro-batch
    chunks of 4096 x 7168 bf16 in flight on a pp rank, 1.8 GiB."""
    blocks = [sum(trace.saved_by_structure.get(k, 0.0) for k in ks) for ks in structures]
    rows = [sum(trace.rows_by_structure.get(k, 0.0) for k in ks) for ks in structures]
    per = [b + (imbalance - 1) * r + hidden for b, r in zip(blocks, rows, strict=True)]
    per[-1] += max(0.0, trace.saved_after_forward - sum(blocks) - hidden)
    return per


def _recompute_share(traces: dict, structures: list) -> list[float]:
    """stage -> its part of the FLOPs `selective` runs again: its trunk blocks' (by
    structure, measured), the rest (the head's, MTP's) on the last stage."""
    from moetrain.planner.recompute_cost import recomputed_by_structure, recomputed_per_token

    if "selective" not in traces or "none" not in traces:
        return [0.0] * len(structures)
    whole = sum(recomputed_per_token(traces).values())
    if not whole:
        return [0.0] * len(structures)
    by_structure = recomputed_by_structure(traces)
    per = [sum(by_structure.get(k, 0.0) for k in ks) for ks in structures]
    per[-1] += max(0.0, whole - sum(per))
    return [f / whole for f in per]


def _held(reuse, order_key: tuple, r: int, per: list[float], cut) -> float:
    """`pipeline_schedule.held_peak` of pp rank `r`, once per schedule order and saved
    bytes of its stages (layouts that differ in ep alone share both)."""

    key = ("held", order_key, r, tuple(per[s] for s in cut.local(r)))
    if key not in reuse.stages:
        reuse.stages[key] = held_peak(reuse.orders[order_key][r], per)
    return reuse.stages[key]


def stage_states(cfg, spec, dims, reuse) -> tuple[_Cut, tuple]:
    """The parts of `measure_pipeline` that do not read a trace, into `reuse`: the cut,
    the schedule's order and every stage's shards (`layout_cost.measure_state`). Returns
    (the cut, the key of the order in `reuse.orders`)."""

    p = cfg.parallel
    c = _cut_of(cfg, spec, reuse)
    n = dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    key = (p.pp_schedule, p.pp, p.pp_virtual_stages, n)
    if key not in reuse.orders:
        reuse.orders[key] = schedule_order(*key)
    for s in range(c.cut.num_stages):
        _stage_shard(cfg, spec, c, s, dims, reuse)
    return c, key


def _sum_states(parts: list) -> object:
    """The elementwise sum of (footprint.ShardedState, how many times it counts) pairs."""
    from dataclasses import fields

    from moetrain.planner.footprint import ShardedState

    return ShardedState(
        *(
            [
                sum(col)
                for col in zip(
                    *([v * n for v in getattr(s, f.name)] for s, n in parts), strict=True
                )
            ]
            for f in fields(ShardedState)
        )
    )


def _stage_shard(cfg, spec, c: _Cut, index: int, dims, reuse) -> tuple:
    """(sharded state, step buffers, gathered, reduced bytes) of stage `index` of cut `c`:
    the sum of its pieces, each trunk block and its ends (the embedding on the first
    stage, the head on the last), each piece measured once per degrees.

    NOTE: FSDP2 shards and pads every parameter on its own and the optimizer keeps state
    per parameter, so a stage's shards are exactly the sum of its pieces' (the update's
    temporaries are summed too: an estimate). Pieces repeat across stages, cuts and
    schedules: a search measures a block structure once per set of degrees."""
    from collections import Counter

    from moetrain.parallelisms.pipeline_build import PipelineCut

    cut = c.cut
    key = (
        "stage",
        repr(dims),
        tuple(cut.blocks[index]),
        index,
        cut.num_stages,
        cut.embedding_on_last,
    )
    if key in reuse.stages:
        return reuse.stages[key]
    counts = Counter(c.structures[index])
    first_of = {}  # structure -> the stage's first block of it, the one measured
    for fqn, structure in zip(cut.blocks[index], c.structures[index], strict=True):
        first_of.setdefault(structure, fqn)
    pieces = [
        (PipelineCut([[], [first_of[k]], []], cut.schedule, cut.pp), 1, ("block", k), n)
        for k, n in counts.items()
    ]
    ends = PipelineCut([[], []], cut.schedule, cut.pp, cut.embedding_on_last)
    if index == 0:
        pieces.append((ends, 0, ("first",), 1))
    if index == cut.num_stages - 1:
        pieces.append((ends, 1, ("last", cut.embedding_on_last), 1))
    measured = [
        (_piece(cfg, spec, c.model, p, i, what, dims, reuse), n) for p, i, what, n in pieces
    ]
    state = _sum_states([(m[0], n) for m, n in measured])
    gathered = sum(m[1] * n for m, n in measured)
    reduced = sum(m[2] * n for m, n in measured)
    reuse.stages[key] = (state, gathered + reduced, gathered, reduced)
    return reuse.stages[key]


def _piece(cfg, spec, model, cut, index: int, what: tuple, dims, reuse) -> tuple:
    """(sharded state, gathered, reduced bytes) of stage `index` of a cut made to hold one
    piece (`what` names it in the cache)."""
    from moetrain.parallelisms.parallelize import parallelize
    from moetrain.parallelisms.pipeline_build import stage_module

    key = repr((shard_key(cfg, dims), what))
    if key not in reuse.stages:
        dtype = param_dtype(cfg)
        stage = stage_module(model, spec.plan, cut, index)
        # NOTE: pp is outermost, so stage 0's ranks are ranks 0..stage_ranks-1 and its
        # groups are those of the same degrees without pp over just those ranks: meshes
        # with 1/pp of the subgroups to create (each size-1 dim makes one per rank).
        own = replace(dims, pp=1, world_size=dims.stage_ranks)
        parallelize(stage, spec.plan, reuse.meshes_of(own), dtype, stage=True)
        state, units = sharded_model(stage, spec.plan, cfg.train, dtype, [], dims.stage_ranks)
        gathered = int(sum(u.gathered * u.weight for u in units))
        reduced = int(sum(u.grads * u.weight for u in units))
        reuse.stages[key] = (state, gathered, reduced)
    return reuse.stages[key]
