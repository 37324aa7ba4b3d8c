"""What a layout costs one rank, measured on the meta device over the fake process group:
the resting state, FSDP's buffers, the activations of each checkpointing mode, the
update's temporaries, and the bytes each collective moves per step (`python -m
moetrain.planner` reports them). A step peaks in its forwards and backwards or in its
update (norm, clip, optimizer step), whichever is higher (`peak_bytes`).

Measured by: `moetrain.planner.shards` (the state), `traces` (the activations),
`pipeline_stages` (pipeline stages), with the instruments of `footprint`. The process group
must be the fake one, already initialised with the launch's world size (the planner's
`main` does that).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.planner.objective_cost import ReferenceCost, reference_cost
from moetrain.planner.shards import MODES, FsdpUnit, Measured, shard, shard_key
from moetrain.planner.traces import trace_key, trace_layout
from moetrain.planner.workers import resolved

__all__ = [
    "MODES",
    "Layout",
    "Measured",
    "measure_layout",
    "measure_state",
    "peak_bytes",
    "step_bytes",
    "update_bytes",
]


@dataclass
class Layout:
    """What the planner measured for one (config, world size)."""

    cfg: object
    dims: object
    state: object  # footprint.ShardedState
    fsdp_buffers: int  # all-gathered/unsharded-gradient buffers alive at once (peak)
    comm: dict  # per step, per rank, bytes
    activations: dict  # mode -> activation_trace.StepTrace
    # parallel.fsdp_gather=step: every unit's gathered parameters and unsharded fp32
    # gradients, held together through the step's last backward
    fsdp_step_buffers: int = 0
    experts: int = 0  # a MoE layer's routed experts and the experts a token takes
    top_k: int = 0
    # parallel.pp > 1: each pp rank's stages (moetrain.planner.pipeline_stages); the state
    # above is then every rank's, stage by stage, and `comm` the busiest pp rank's
    pipeline: object = None
    # the routing's node bound (the spec's `routing_groups`): (expert groups, per token)
    routing_groups: tuple[int, int] | None = None
    # the busiest expert-parallel rank's routed rows over the mean (1 without EP: a rank
    # holding every expert takes every row whatever the routing); its saved rows grow by it
    routing_imbalance: float = 1.0
    # train.objective=dpo: what its reference adds (moetrain.planner.objective_cost)
    reference: ReferenceCost | None = None


# The default of `--routing-imbalance` (docs/planner.md, "Will it fit?"): 10% more routed
# rows on the busiest expert-parallel rank than balanced routing gives it.
ROUTING_IMBALANCE = 1.1


def measure_layout(
    cfg,
    world_size: int,
    modes=MODES,
    reuse: Measured | None = None,
    routing_imbalance: float = ROUTING_IMBALANCE,
) -> Layout:
    """The full measurement of one layout (the process group must be the fake one);
    `reuse`: what earlier layouts of the same model measured (filled in as it goes);
    `routing_imbalance`: the busiest expert-parallel rank's routed rows over the mean."""
    reuse = reuse if reuse is not None else Measured()
    dims, spec = measure_state(cfg, world_size, reuse)
    imbalance = routing_imbalance if dims.ep > 1 else 1.0
    if dims.pp > 1:
        return _measure_stages(cfg, spec, dims, modes, reuse, imbalance)
    key = repr(shard_key(cfg, dims))
    state, units = reuse.shards[key] = resolved(reuse.shards[key])  # a worker's (search)
    grad_accum = dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    activations = {
        m: t.at_grad_bytes(state.grads[0])
        for m, t in _traces(cfg, spec, dims, modes, reuse).items()
    }
    any_trace = activations[modes[0]]
    reference = reference_cost(cfg, dims, state, grad_accum)
    comm = _comm(units, dims, grad_accum, any_trace, reference)
    return Layout(
        cfg,
        dims,
        state,
        _fsdp_buffers(units),
        {**comm, "optimizer_memory": optimizer_memory(state)},
        activations,
        int(sum((u.gathered + u.grads) * u.weight for u in units)),
        any_trace.experts,
        any_trace.top_k,
        routing_groups=_routing_groups(cfg, spec),
        routing_imbalance=imbalance,
        reference=reference,
    )


def measure_state(cfg, world_size: int, reuse: Measured) -> tuple:
    """What `measure_layout` measures besides its traces, into `reuse`: the sharding of
    the whole model, or of each pipeline stage's pieces. Returns (dims, model spec)."""
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.dims import ParallelDims
    from moetrain.planner.pipeline_stages import stage_states

    dims = ParallelDims.of(cfg.parallel, world_size)
    spec = get_model_spec(cfg.model.name)
    if dims.pp > 1:
        stage_states(cfg, spec, dims, reuse)
        return dims, spec
    key = repr(shard_key(cfg, dims))
    if key not in reuse.shards:
        reuse.shards[key] = shard(cfg, spec, dims, world_size, reuse.meshes_of(dims), reuse)
    return dims, spec


def _traces(cfg, spec, dims, modes, reuse: Measured) -> dict:
    """mode -> the trace of one micro-batch at this layout's local shapes, each traced once
    per (micro-batch, cp, mode); priced at no gradient bytes (`at_grad_bytes` re-prices)."""
    out = {}
    for mode in modes:
        at = trace_key(cfg, dims, mode)
        if at not in reuse.traces:
            reuse.traces[at] = trace_layout(cfg, spec, dims, mode, reuse.meshes_of(dims), reuse)
        out[mode] = reuse.traces[at] = resolved(reuse.traces[at])  # a worker's (search)
    return out


def _measure_stages(cfg, spec, dims, modes, reuse: Measured, imbalance: float) -> Layout:
    """measure_layout under pipeline stages: the whole model's traces (stages take their
    blocks' part of them), each pp rank's stages sharded (moetrain.planner.pipeline_stages)."""
    from moetrain.planner.footprint import ShardedState
    from moetrain.planner.pipeline_stages import measure_pipeline

    traces = _traces(cfg, spec, dims, modes, reuse)
    pc = measure_pipeline(cfg, spec, dims, traces, reuse, imbalance)
    state = ShardedState(
        *(
            [v for r in pc.ranks for v in getattr(r.state, f)]
            for f in ("params", "grads", "optimizer", "update", "frozen")
        )
    )
    # DPO's reference: its forward's all-to-all pair, its sums held by the last stage's
    # ranks (`step_bytes`); the stages' units stay gathered, no gather again
    reference = reference_cost(cfg, dims, state, pc.micro_batches)
    whole = _comm([], dims, pc.micro_batches, traces[modes[0]], reference)  # no FSDP
    busiest = max(sum(pc.moe_share[s] for s in r.stages) for r in pc.ranks)
    ring = max(sum(pc.core_share[s] for s in r.stages) for r in pc.ranks)
    gathered = max(r.gathered for r in pc.ranks)
    reduced = max(r.reduced for r in pc.ranks)
    comm = {
        **whole,
        # stages keep their units gathered and reduce once per step (pipeline_stages)
        "fsdp_all_gather_once": gathered,
        "fsdp_reduce_scatter_once": reduced,
        "fsdp_all_gather": gathered,
        "fsdp_reduce_scatter": reduced,
        "hsdp_all_reduce": reduced // dims.fsdp_size if dims.dp_replicate > 1 else 0,
        **{k: int(whole[k] * busiest) for k in ("ep_all_to_all", "ep_all_to_all_full_ac")},
        **{k: int(whole[k] * ring) for k in ("cp_ring", "cp_ring_full_ac")},
        "pp_p2p": max(r.p2p for r in pc.ranks),
        "optimizer_memory": optimizer_memory(state),
    }
    any_trace = traces[modes[0]]
    buffers = max(r.step_buffers for r in pc.ranks)
    return Layout(
        cfg,
        dims,
        state,
        buffers,
        comm,
        traces,
        buffers,
        any_trace.experts,
        any_trace.top_k,
        pc,
        _routing_groups(cfg, spec),
        imbalance,
        reference,
    )


def _routing_groups(cfg, spec) -> tuple[int, int] | None:
    return None if spec.routing_groups is None else spec.routing_groups(cfg.model.args)


def _fsdp_buffers(units: list[FsdpUnit]) -> int:
    """FSDP's buffers alive when activations peak (the end of forward, the loss and the
    start of backward): the root's gathered parameters (kept from forward to backward) and
    one block group (a block and its experts' units) gathered, with its all-gather input.
    NOTE: later in backward two groups are gathered at once and one group's unsharded
    gradients wait for their reduce-scatter, but by then most activations are freed; on
    the debug config on CPU this sum matches the measured peak best (docs: Will it fit?)."""
    root = sum(u.gathered for u in units if not u.resharded)
    groups: dict[int, int] = {}
    for u in units:
        if u.resharded and u.block is not None:
            groups[u.block] = groups.get(u.block, 0) + u.gathered + u.copied
    return root + max(groups.values(), default=0)


def _comm(
    units: list[FsdpUnit], dims, grad_accum: int, trace, reference: ReferenceCost | None = None
) -> dict:
    """Per step, per rank. FSDP: bytes of the gathered outputs and of the reduce-scatter
    inputs (a ring algorithm moves (n-1)/n of each over the wire). EP: bytes this rank
    sends to other ranks when each expert gets an equal share (dispatch and combine, in
    forward and backward; `full` checkpointing adds the replay's forward pair). CP: the
    K/V blocks passed on (cp-1 hops forward and backward) and the fp32 dK/dV sums (cp
    hops). `reference`: DPO's reference forward (`objective_cost`), one more all-to-all
    pair a micro-batch, and its gathers: the step's reference forwards run before its first
    forward, so the units kept gathered after a forward (the root; every unit under
    fsdp_gather=step) are gathered once for them and the step's forwards alike, the others
    once more a micro-batch; a copy's units are its own, gathered besides."""
    gathers = sum(u.gathered * (2 if u.resharded else 1) * u.weight for u in units)
    scatters = sum(u.grads * u.weight for u in units)
    leaving = (dims.ep - 1) / dims.ep
    a2a_pair = trace.routed * leaving * 2  # dispatch and combine
    cp = dims.cp
    ring = 0 if cp == 1 else trace.kv * (cp - 1) * 2 + trace.kv_fp32 * cp
    gathered_once = sum(u.gathered * u.weight for u in units)  # fsdp_gather=step
    forwards = reference.forwards if reference is not None else 0
    own = forwards and reference.source == "copy"
    kept = sum(u.gathered * u.weight for u in units if not u.resharded)
    again = (gathered_once - kept) * forwards * grad_accum + (kept if own else 0)
    a2a_pairs = 2 + forwards  # forward and backward, and the reference's forward
    return {
        "fsdp_all_gather_once": int(gathered_once + (gathered_once if own else 0)),
        "fsdp_reduce_scatter_once": int(scatters),
        "fsdp_all_gather": int(gathers * grad_accum + again),
        "fsdp_reduce_scatter": int(scatters * grad_accum),
        "hsdp_all_reduce": int(scatters / dims.fsdp_size * grad_accum)
        if dims.dp_replicate > 1
        else 0,
        "ep_all_to_all": int(a2a_pair * a2a_pairs * grad_accum),
        "ep_all_to_all_full_ac": int(a2a_pair * (a2a_pairs + 1) * grad_accum),
        "cp_ring": int(ring * grad_accum),
        # full checkpointing's replay sends the forward's K/V blocks again
        "cp_ring_full_ac": int((ring + (trace.kv * (cp - 1) if cp > 1 else 0)) * grad_accum),
        "micro_batches": grad_accum,
    }


def optimizer_memory(state) -> int:
    """Bytes the optimizer step moves through the busiest rank's memory (not a collective:
    `step_cost` prices it at the GPU's memory bandwidth). AdamW reads each trained
    parameter's shard, its gradient and its moments and writes the parameter and the
    moments back: 2 x (params - frozen) + grads + 2 x optimizer state. The norm and clip
    before it are not counted (a read or two of the gradients)."""
    return max(
        2 * (p - f) + g + 2 * o
        for p, g, o, f in zip(state.params, state.grads, state.optimizer, state.frozen, strict=True)
    )


def step_bytes(layout: Layout, mode: str, rank: int = 0, gather: str | None = None) -> int:
    """What the forwards and backwards of a step add to the resting state at their highest
    point: activations and gradients (all of them already, from the second micro-batch of
    an accumulation on), FSDP's buffers, and DPO's reference log-probabilities held
    through the forwards. `gather`: `parallel.fsdp_gather` (default: the config's); with
    `step`, every unit's gathered parameters and unsharded gradients instead."""
    trace = layout.activations[mode]
    pc = layout.pipeline
    if pc is not None:  # the rank's stages: their micro-batches in flight, all units gathered
        pp_rank = rank // layout.dims.stage_ranks
        held = pc.ranks[pp_rank].step_buffers
        last = max(s for r in pc.ranks for s in r.stages)
        if layout.reference is not None and last in pc.ranks[pp_rank].stages:
            held += layout.reference.held  # the last stage's, which computes the loss
        return pc.activations[mode][pp_rank] + layout.state.grads[rank] + held
    margin = rows_margin(layout, mode)
    margin += layout.reference.held if layout.reference is not None else 0
    if (gather or layout.dims.fsdp_gather(layout.cfg.parallel.fsdp_gather)) == "step":
        return trace.activations + margin + layout.fsdp_step_buffers
    if layout.comm["micro_batches"] > 1:
        working = trace.activations + layout.state.grads[rank]
    else:
        working = trace.peak
    return working + margin + layout.fsdp_buffers


def rows_margin(layout: Layout, mode: str) -> int:
    """Bytes the busiest expert-parallel rank saves above balanced routing at its peak:
    `routing_imbalance` - 1 of its saved routed rows (under pp, of its stages' micro-batches
    in flight, the most of any pp rank's: already in the pipeline's activations)."""
    pc = layout.pipeline
    if pc is None:
        return int((layout.routing_imbalance - 1) * layout.activations[mode].saved_rows)
    return max(pc.imbalance_bytes[mode])


def update_bytes(layout: Layout, rank: int = 0) -> int:
    """What the update (norm, clip, optimizer step) adds to the resting state at its
    highest point: every gradient, and the temporaries of the update itself."""
    return layout.state.grads[rank] + layout.state.update[rank]


def peak_bytes(
    layout: Layout, mode: str, rank: int | None = None, gather: str | None = None
) -> int:
    """The rank's peak: resting state (with DPO's reference copy or stored table) plus the
    higher of the two phases of a step. `rank` None: the highest (rank 0 holds the most,
    but under pipeline stages any first rank of a stage group may)."""
    if rank is None:
        firsts = range(0, layout.dims.world_size, layout.dims.stage_ranks)
        return max(peak_bytes(layout, mode, r, gather) for r in firsts)
    s = layout.state
    working = max(step_bytes(layout, mode, rank, gather), update_bytes(layout, rank))
    resting = layout.reference.resting[rank] if layout.reference is not None else 0
    return s.params[rank] + s.optimizer[rank] + resting + working
