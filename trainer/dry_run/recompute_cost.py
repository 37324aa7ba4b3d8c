"""What `train.activation_checkpoint = "selective"` computes again in backward, measured
(`trainer.dry_run.step_cost.estimate` adds it to a step's compute; docs/planner.md,
"Step-time model").

The planner's traces of `none` and `selective` (`trainer.dry_run.traces.trace_layout`) run
under torch's `FlopCounterMode`, which counts the FLOPs of matrix products and attention
kernels per module, backward included. A `selective` block's backward runs its recomputed
regions again (`models/common/recompute.py`) and nothing else differs, so the two traces'
difference, block structure by block structure, is what the regions' GEMMs cost once more
(DeepSeek-V3's MLA: the up-projections, 2 x (q_b_proj + kv_b_proj parameters) per token
and layer). Element-wise work (norms, SwiGLU's product, RoPE) is not counted, as the
step-time model counts none elsewhere.

NOTE: `FlopCounterMode` has no formula for the grouped GEMM or the CPU attention kernels
the meta trace runs; no recomputed region holds either (a region is small and cheap by
design), so the difference misses nothing of the kinds it splits into.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.flop_counter import FlopCounterMode

from parallelisms.plan import match_modules


@dataclass
class GemmFlops:
    """What `FlopCounterMode` counted in one micro-batch's trace, per token of it."""

    total: dict[str, float]  # kind -> the whole model's (dropped blocks added back)
    by_structure: dict  # footprint.block_structure -> kind -> one such block's


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False)


def _kind(op) -> str:
    # the kinds of models.common.flops.KINDS: what the counter counts is a dense GEMM
    # (mm, addmm, bmm) or an attention kernel
    return "attention" if "attention" in str(op) else "dense"


def _by_kind(op_counts: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for op, flops in op_counts.items():
        out[_kind(op)] = out.get(_kind(op), 0.0) + flops
    return out


def gemm_flops(counter: FlopCounterMode, model, plan, sampled, tokens: int) -> GemmFlops:
    """The counts of `counter` (which ran one micro-batch of `tokens` tokens through the
    plain `model`) per token, per block structure, and for the whole model with what
    `footprint.sample_blocks` dropped added back (`sampled`), as the trace adds its bytes."""
    from trainer.dry_run.footprint import block_structure

    counts = counter.get_flop_counts()
    root = type(model).__name__  # the counter names modules from the model it saw first
    blocks = match_modules(model, plan.blocks, "blocks")
    outer = [(f, b) for f, b in blocks if not any(f.startswith(g + ".") for g, _ in blocks)]
    per_block = {id(b): _by_kind(counts.get(f"{root}.{f}", {})) for f, b in outer}

    def mean(ids: list[int]) -> dict[str, float]:
        kinds = {k for i in ids for k in per_block[i]}
        return {k: sum(per_block[i].get(k, 0.0) for i in ids) / len(ids) for k in kinds}

    groups: dict[tuple, list[int]] = {}
    for _, b in outer:
        groups.setdefault(block_structure(b), []).append(id(b))
    total = _by_kind(counts.get("Global", {}))
    for kept, dropped in sampled:
        for k, f in mean([id(b) for b in kept if id(b) in per_block]).items():
            total[k] = total.get(k, 0.0) + dropped * f
    by_structure = {s: {k: f / tokens for k, f in mean(ids).items()} for s, ids in groups.items()}
    return GemmFlops({k: f / tokens for k, f in total.items()}, by_structure)


def _pair(activations: dict) -> tuple[GemmFlops, GemmFlops]:
    try:
        return activations["selective"].gemm_flops, activations["none"].gemm_flops
    except KeyError as err:  # measure_layout measures every mode unless told fewer
        raise ValueError(
            "the selective recomputation's FLOPs are measured from the traces of both "
            f"`selective` and `none`; this layout has no {err} trace"
        ) from None


def recomputed_per_token(activations: dict) -> dict[str, float]:
    """kind -> FLOPs per token `selective` runs again, the whole model's; `activations`:
    a layout's traces by mode (`layout_cost.Layout.activations`)."""
    sel, none = _pair(activations)
    kinds = set(sel.total) | set(none.total)
    diff = {k: sel.total.get(k, 0.0) - none.total.get(k, 0.0) for k in kinds}
    return {k: f for k, f in diff.items() if f > 0}


def recomputed_by_structure(activations: dict) -> dict:
    """block structure -> FLOPs per token `selective` runs again in one such block."""
    sel, none = _pair(activations)
    out = {}
    for s, kinds in sel.by_structure.items():
        other = none.by_structure.get(s, {})
        out[s] = max(0.0, sum(kinds.values()) - sum(other.values()))
    return out
