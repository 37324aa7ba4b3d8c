"""Pipeline stages in the planner (`parallel.pp` > 1): a step's time with its bubble
(`pipeline_step`, which `moetrain.planner.step_cost.estimate` calls), from what
`moetrain.planner.pipeline_stages` measured.

- Time (`pipeline_schedule.simulate`): every rank's actions replayed in order. An action
  starts when its rank is free and its input is in: a forward after the previous stage's forward, a
  backward after the next stage's, plus a send's time between two ranks. A forward takes
  a third of the stage's training compute, the backward two thirds (the zero-bubble
  schedules split it evenly into input and weight backward; `full` checkpointing's replay
  adds a third to the input backward, `selective`'s rebuilds the stage's measured share of
  them: `recompute_cost`). The stage's share of the expert all-to-all runs in
  its forward and input backward, less what `parallel.ep_overlap` hides under them
  (`a2a_cost.a2a_hidden`, as without pp); the ring's transfers
  run under the compute. The step is the last action's end plus the FSDP traffic compute
  does not hide: the gathers beyond the first forward, the reduction after the last
  backward. The bubble is the busiest rank's idle time.
- DPO's reference (`reference_forwards`: dpo.reference=base) runs before the schedule, the
  step's micro-batches through the stages forward only (moetrain/loop/pipelined.py
  `StagedEvaluation.logps`): each rank runs its stages' forwards of every micro-batch, the
  last stage's first forward waiting for the others' (the fill): n x the busiest rank's
  stage forwards + (pp - 1) x the longest stage forward.
"""

from __future__ import annotations

from moetrain.planner.a2a_cost import a2a_hidden, a2a_seconds
from moetrain.planner.hardware import GB, link
from moetrain.planner.pipeline_schedule import simulate


def pipeline_step(
    layout,
    mode: str,
    compute_s: float,
    seconds: dict,
    hw,
    hides=(0.0, 0.0),
    form="none",
    recompute_s: float = 0.0,
    fp8_s: float = 0.0,
    reference_forwards: int = 0,
) -> tuple[float, dict]:
    """(step seconds, what else the estimate reports) of a layout with pipeline stages.
    `compute_s`: the training compute of a rank's share of the step as if the ranks were
    one stage group each (step_cost.estimate's, replay included); `seconds`: its collective
    times (FSDP's are once per step here); `hides`: the routed and shared experts' shares
    of the compute (`a2a_cost.overlap_shares`), for the credit of `form`
    (parallel.ep_overlap); `recompute_s`: what `selective` runs again, on the same
    footing as `compute_s` (not in it), in the input backward of each stage by its share;
    `fp8_s`: of `compute_s`, the FP8 GEMMs' (train.fp8), which a stage takes by its share
    of them, and the rest by its share of the rest (in bf16 the FLOPs' shares);
    `reference_forwards`: DPO's reference forwards per micro-batch, in `compute_s` (a third
    of the training compute each), run forward only before the schedule."""
    pc, dims = layout.pipeline, layout.dims
    shares = pc.flops_share
    if fp8_s:  # the head, the routers and attention stay in bf16: their stages weigh more
        rest_s = compute_s - fp8_s
        shares = [
            (g * fp8_s + r * rest_s) / compute_s
            for g, r in zip(pc.fp8_share, pc.rest_share, strict=True)
        ]
    trace = layout.activations[mode]
    n, full = pc.micro_batches, mode == "full"
    replay = (4 / 3 if full else 1.0) + reference_forwards / 3
    # one micro-batch through the whole model, on one rank of a stage group
    third = compute_s / replay * dims.pp / n / 3
    again = recompute_s * dims.pp / n  # one micro-batch's rebuilds, the whole model's
    pair = trace.routed * (dims.ep - 1) / dims.ep * 2  # dispatch + combine, all MoE layers
    a2a_pass = a2a_seconds(pair, layout, hw)[0]
    cp, ring_link = dims.cp, link(dims.cp, hw) * GB
    ring_fwd = trace.kv * (cp - 1) / ring_link if cp > 1 else 0.0
    ring_bwd = ring_fwd + trace.kv_fp32 * cp / ring_link if cp > 1 else 0.0
    durations: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}
    # of each stage's forward and full backward, the all-to-all seconds left exposed: an
    # overlapped pair of DualPipeV hides them under each other (pipeline_schedule.simulate)
    exposed: dict[str, list[float]] = {"F": [], "B": []}
    rhos = pc.recompute_share
    for phi, mu, core, rho in zip(shares, pc.moe_share, pc.core_share, rhos, strict=True):
        # the stage's all-to-all in one pass; what of it hides under a forward's compute,
        # which is also an input backward's (the input gradients: a forward's worth), and
        # under a whole backward's (twice that)
        a2a, (experts, shared) = mu * a2a_pass, (phi * third * h for h in hides)
        hidden_f = a2a_hidden(form, a2a, experts, shared)
        hidden_b = a2a_hidden(form, a2a, 2 * experts, 2 * shared)
        # the input backward's all-to-all (with full checkpointing, the replay's too)
        a2a_i = a2a * (2 if full else 1) - (hidden_f if full else 0.0)
        f = max(phi * third, core * ring_fwd) + a2a - hidden_f
        i = max(phi * third * (2 if full else 1), core * (ring_bwd + (ring_fwd if full else 0)))
        i += a2a_i + rho * again
        w = phi * third
        durations["F"].append(f)
        durations["I"].append(i - hidden_f)
        durations["W"].append(w)
        durations["B"].append(i + w - hidden_b)
        exposed["F"].append(a2a - hidden_f)
        exposed["B"].append(a2a_i - hidden_b)
    # pp neighbours are a stage group apart: in one node only if the whole job is
    p2p_s = pc.hidden_bytes / (link(dims.world_size, hw) * GB)
    pairs = layout.cfg.parallel.pp_schedule == "DualPipeV" and dims.ep > 1 and form != "none"
    span, busy = simulate(pc.order, pc.rank_of, durations, p2p_s, exposed if pairs else None)
    fsdp_n = dims.fsdp_size
    ring_f = (fsdp_n - 1) / fsdp_n / (link(fsdp_n, hw) * GB)
    gather_s = layout.comm["fsdp_all_gather"] * ring_f
    reduce_s = layout.comm["fsdp_reduce_scatter"] * ring_f
    # NOTE: FSDP's prefetch hides the gathers under the first forward of rank 0 (the first
    # stage); the reduction follows the last backward, and HSDP's all-reduce follows it.
    exposed = max(0.0, gather_s - durations["F"][0]) + reduce_s + seconds["hsdp"]
    busiest = max(range(dims.pp), key=lambda r: busy[r])
    mine = pc.ranks[busiest].stages
    forwards = [sum(durations["F"][s] for s in r.stages) for r in pc.ranks]
    reference_s = (n * max(forwards) + (dims.pp - 1) * max(durations["F"])) * reference_forwards
    per_micro_batch = 3 + (1 if full else 0) + reference_forwards
    return span + exposed + reference_s, {
        "compute_s": sum(shares[s] * third * per_micro_batch + rhos[s] * again for s in mine) * n,
        "reference_pass_s": reference_s,
        "exposed_background_s": exposed,
        "pipeline_span_s": span,
        "bubble_s": span - busy[busiest],
        "bubble": (span - busy[busiest]) / span,
        "p2p_s": p2p_s,
        "p2p_bytes": layout.comm["pp_p2p"],
        # the busiest pp rank's compute over the mean rank's (its stages' shares)
        "busiest_load": busy[busiest] / (sum(busy) / len(busy)),
    }
