"""A step's time on a layout: the step-time model over the planner's measured bytes and
FLOPs (`estimate`; `python -m moetrain.planner`, and `--search` ranks layouts by it:
`moetrain.planner.search`; docs/planner.md, "Step-time model").

The model, per rank and step (every figure it uses is printed with the estimate):

- compute: training FLOPs of the rank's tokens (the model's own `flops_per_token`, as MFU
  counts them; `full` checkpointing adds one forward: x4/3, and so does DPO's reference
  forward (`objective_cost`: dpo.reference base or copy); `selective` adds the GEMM
  FLOPs its recomputed regions run again, measured: `recompute_cost`, DeepSeek-V3's MLA
  up-projections, dense GEMMs) / (peak x efficiency);
  with measured rates (`--gemm-rates FILE`, the JSON of `benchmarks/gemm_rates.py`) the
  sum over kinds of kernel (dense GEMMs, grouped expert GEMMs, attention: the split the
  model's count carries, `moetrain.models.common.flops.FlopsPerToken`) of each kind's FLOPs /
  (peak x that kind's measured efficiency), instead of one constant efficiency;
- each collective's bytes on the wire (ring algorithms: (n-1)/n of an all-gather or
  reduce-scatter, 2(n-1)/n of an all-reduce; the all-to-all's bytes already leave the
  rank) / the bandwidth of the link it crosses: inside a node while its group fits in one
  (groups are runs of consecutive ranks, `moetrain.parallelisms.mesh`), else across nodes; an
  all-to-all over more ranks than a node splits its bytes between the two, and its
  two-stage dispatch (`moetrain.parallelisms.node_dispatch`) sends one row per (token, remote node)
  across instead of one per (token, remote expert): `node_share` of them under uniform
  routing, the crossed rows fanning out again inside the node after they arrive (the
  stages' times add up);
- overlap as the trainer has it: FSDP's gathers and reductions are prefetched and run
  under compute, and so do the ring's transfers (posted before each block is computed), so
  only what exceeds the compute shows; of the expert all-to-all, what `parallel.ep_overlap`
  leaves in flight hides under the compute between its issue and its wait
  (`a2a_cost.a2a_hidden`, which states the rule): step = compute + all-to-all - hidden +
  max(0, background - compute) + optimizer;
- the optimizer step: the bytes it streams through the busiest rank's memory
  (`layout_cost.optimizer_memory`) at the GPU's memory bandwidth (`--memory-gbps`).

Not modelled: element-wise work (norms, activations, the routing's permutations), host
synchronisations, routing imbalance (balanced routing, as the byte counts), latency of
small messages; without `--gemm-rates`, kernel efficiency by shape.
"""

from __future__ import annotations

from moetrain.planner.a2a_cost import a2a_hidden, a2a_seconds, overlap_shares
from moetrain.planner.hardware import GB, Hardware, link
from moetrain.planner.objective_cost import ReferenceCost
from moetrain.planner.pipeline_cost import pipeline_step
from moetrain.planner.recompute_cost import recomputed_per_token

# Bytes per element of one quantisation pass of an FP8 GEMM's input: its amax reads the
# bf16 tensor (2), the scale-and-cast reads it again (2) and writes the fp8 copy (1).
QUANTISE_BYTES = 5


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
    reference = layout.reference or ReferenceCost("none", 0, [], 0)
    # a forward is a third of the training count: `full`'s replay, DPO's reference forward
    replay = (4 / 3 if mode == "full" else 1.0) + reference.forwards / 3
    flops = flops_per_token * tokens / dims.world_size * replay
    # what `selective` runs again in backward, per token, by kind (measured)
    again = recomputed_per_token(layout.activations) if mode == "selective" else {}
    flops += sum(again.values()) * tokens / dims.world_size
    fp8 = fp8_gemms(cfg, flops_per_token, hw)
    by_kind_s, again_s, fp8_s = _compute_by_kind(
        flops_per_token, by_kind, again, hw, tokens / dims.world_size, replay, fp8
    )
    quantise = quantise_bytes(layout, fp8, tokens, replay) if fp8 is not None else 0
    quantise_s = quantise / (hw.memory_gbps * GB)
    compute_s = sum(by_kind_s.values()) + quantise_s
    fp8_s += quantise_s
    recompute_s = sum(again_s.values())
    fsdp_n = dims.dp_shard * dims.cp
    ring_f = (fsdp_n - 1) / fsdp_n
    once = dims.fsdp_gather(cfg.parallel.fsdp_gather) == "step"
    gather = comm["fsdp_all_gather_once" if once else "fsdp_all_gather"]
    scatter = comm["fsdp_reduce_scatter_once" if once else "fsdp_reduce_scatter"]
    seconds = {
        "fsdp": (gather + scatter) * ring_f / (link(fsdp_n, hw) * GB),
        # replicas are fsdp_n ranks apart: across nodes once a shard group fills a node
        "hsdp": comm["hsdp_all_reduce"]
        * 2
        * (dims.dp_replicate - 1)
        / dims.dp_replicate
        / (link(fsdp_n * dims.dp_replicate, hw) * GB),
        "cp_ring": comm["cp_ring_full_ac" if mode == "full" else "cp_ring"]
        / (link(dims.cp, hw) * GB),
    }
    a2a = comm["ep_all_to_all_full_ac" if mode == "full" else "ep_all_to_all"]
    seconds["ep_all_to_all"], share = a2a_seconds(a2a, layout, hw)
    background = seconds["fsdp"] + seconds["hsdp"] + seconds["cp_ring"]
    # the shares of the compute under which a MoE layer's all-to-all may run
    hides, form = overlap_shares(flops_per_token, by_kind_s), overlap or cfg.parallel.ep_overlap
    precision = _precision(cfg, hw, fp8, quantise, quantise_s, fp8_s)
    # the optimizer step streams the rank's state once per step, after the last backward
    optimizer_s = comm["optimizer_memory"] / (hw.memory_gbps * GB)
    if layout.pipeline is not None:
        step_s, extra = pipeline_step(
            layout,
            mode,
            compute_s,
            seconds,
            hw,
            hides,
            form,
            recompute_s,
            fp8_s,
            reference.forwards,
        )
        step_s += optimizer_s
        return {
            "flops_per_rank": flops,
            "compute_s": extra.pop("compute_s"),
            "comm_s": seconds,
            "node_share": share,
            "experts": layout.experts,
            "top_k": layout.top_k,
            "optimizer_s": optimizer_s,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "recompute_s": recompute_s,
            "recomputed_flops_per_token": sum(again.values()),
            "precision": precision,
            **extra,
            **_reference_figures(reference, flops_per_token, by_kind, hw, tokens, dims, fp8),
        }
    # the replay's forward and the reference's move their tokens again
    forwards = (2 if mode == "full" else 1) + reference.forwards
    pass_s = seconds["ep_all_to_all"] / (forwards + 1)
    experts_s, shared_s = (compute_s / (forwards + 2) * h for h in hides)  # in one forward
    hidden = forwards * a2a_hidden(form, pass_s, experts_s, shared_s)
    hidden += a2a_hidden(form, pass_s, 2 * experts_s, 2 * shared_s)  # backward: twice
    compute_s += recompute_s  # the rebuilds run in backward, under no all-to-all of theirs
    step_s = compute_s + seconds["ep_all_to_all"] - hidden + max(0.0, background - compute_s)
    step_s += optimizer_s
    out = {
        "flops_per_rank": flops,
        "compute_s": compute_s,
        "recompute_s": recompute_s,  # of compute_s, what `selective` runs again
        "recomputed_flops_per_token": sum(again.values()),
        "comm_s": seconds,
        "ep_hidden_s": hidden,  # of comm_s["ep_all_to_all"], what runs under compute
        "exposed_background_s": max(0.0, background - compute_s),
        "optimizer_s": optimizer_s,  # the optimizer step, at the GPU's memory bandwidth
        "node_share": share,  # of the remote all-to-all rows, what crosses nodes
        "experts": layout.experts,
        "top_k": layout.top_k,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "precision": precision,
    }
    if by_kind is not None:
        out["compute_by_kind_s"] = {k: v + again_s.get(k, 0.0) for k, v in by_kind_s.items()}
    out.update(_reference_figures(reference, flops_per_token, by_kind, hw, tokens, dims, fp8))
    return out


def _reference_figures(reference, flops_per_token, by_kind, hw, tokens, dims, fp8) -> dict:
    """What the estimate reports of DPO's reference (`objective_cost`): the FLOPs its
    forward adds to the rank's step, or the seconds of the stored reference's one-off
    pass, one forward over the corpus' tokens at the step's rates."""
    if reference.source == "none":
        return {}
    out = {"reference": reference.source}
    if reference.forwards:
        out["reference_flops_per_rank"] = (
            float(flops_per_token) / 3 * reference.forwards * tokens / dims.world_size
        )
    if reference.first_pass_tokens:
        per_rank = reference.first_pass_tokens / dims.world_size
        seconds, _, _ = _compute_by_kind(flops_per_token, by_kind, {}, hw, per_rank, 1 / 3, fp8)
        out["first_pass_tokens"] = reference.first_pass_tokens
        out["first_pass_s"] = sum(seconds.values())
    return out


def fp8_gemms(cfg, flops_per_token, hw: Hardware):
    """The GEMMs `train.fp8` runs in FP8 (`model_counts.GemmCounts`), None in bf16."""
    gemms = getattr(flops_per_token, "gemms", None)
    if cfg.train.fp8 == "none" or gemms is None:
        return None
    if not hw.fp8_tflops:
        from moetrain.config import ConfigError

        raise ConfigError(
            f"train.fp8={cfg.train.fp8}: {hw.name} has no FP8 rate; give --gpu-fp8-tflops"
        )
    return gemms


def _compute_by_kind(flops_per_token, by_kind, again, hw, per_rank, replay, fp8):
    """(kind -> seconds of the rank's training FLOPs, kind -> seconds of what `selective`
    runs again, seconds of them in FP8): each kind at its efficiency (measured, `by_kind`,
    else `hw.efficiency`) of the bf16 peak, and under `fp8` (GemmCounts) its FP8 GEMMs
    (the grouped ones, and the dense ones but the routers and the head) of the FP8 peak.
    NOTE: FP8 kernels taken at the bf16 kernels' efficiency, until measured."""
    split = getattr(flops_per_token, "by_kind", None) or {"dense": float(flops_per_token)}
    eff = {k: by_kind[k][1] if by_kind else hw.efficiency for k in split if split[k]}
    in_fp8 = dict.fromkeys(split, 0.0)
    if fp8 is not None:
        in_fp8["grouped"] = split.get("grouped", 0.0)
        in_fp8["dense"] = max(0.0, fp8.fp8_flops - in_fp8["grouped"])
    rate = lambda k, low: (hw.fp8_tflops if low else hw.tflops) * 1e12 * eff[k]  # noqa: E731
    low_s = {k: per_rank * replay * in_fp8[k] / rate(k, True) for k in eff}
    by_kind_s = {
        k: per_rank * replay * (split[k] - in_fp8[k]) / rate(k, False) + low_s[k] for k in eff
    }
    # a kind the model's split lacks runs at its dense GEMMs' efficiency; what `selective`
    # rebuilds (MLA's up-projections, the experts' down-projection, the shared experts'
    # gate and up) are FP8 GEMMs too
    eff.update({k: eff.get("dense", hw.efficiency) for k in again if k not in eff})
    again_s = {
        k: per_rank * f / rate(k, fp8 is not None and k in ("dense", "grouped"))
        for k, f in again.items()
    }
    fp8_again = sum(v for k, v in again_s.items() if fp8 is not None and k != "attention")
    return by_kind_s, again_s, sum(low_s.values()) + fp8_again


def quantise_bytes(layout, fp8, tokens: int, replay: float) -> float:
    """Bytes the busiest rank moves through its memory in a step to quantise the FP8 GEMMs'
    inputs: the activations' (`GemmCounts.quantise_bytes` a token, the rank's tokens) and
    the weights', each micro-batch's forward and input gradient quantising the rank's
    weights (its stages' share of the dense ones, its 1/ep of the experts) at 5 bytes an
    element; `full`'s replay quantises a third more, as it computes."""
    dims = layout.dims
    weights = (fp8.dense_weights + fp8.routed_weights / dims.ep) / dims.pp
    per_step = layout.comm["micro_batches"] * weights * 2 * QUANTISE_BYTES
    return (fp8.quantise_bytes * tokens / dims.world_size + per_step) * replay


def _precision(cfg, hw, fp8, quantise: float, quantise_s: float, fp8_s: float) -> dict:
    """What the estimate reports of `train.fp8`."""
    if fp8 is None:
        return {"fp8": "none"}
    return {
        "fp8": cfg.train.fp8,
        "fp8_tflops": hw.fp8_tflops,
        "fp8_flops_per_token": fp8.fp8_flops,
        "quantise_bytes": quantise,
        "quantise_s": quantise_s,
        "fp8_s": fp8_s,  # of compute_s: the FP8 GEMMs and their quantisation
    }
