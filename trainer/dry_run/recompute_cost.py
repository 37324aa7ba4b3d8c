"""What `train.activation_checkpoint = "selective"` computes again in backward
(`trainer.dry_run.step_cost.estimate` adds it to a step's compute; docs/planner.md,
"Step-time model"), from the FLOPs the traces measured (a costs-layer file: figures in,
FLOPs out; the counting itself is `trainer.dry_run.traces.gemm_flops`).

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


@dataclass
class GemmFlops:
    """What `FlopCounterMode` counted in one micro-batch's trace, per token of it."""

    total: dict[str, float]  # kind -> the whole model's (dropped blocks added back)
    by_structure: dict  # footprint.block_structure -> kind -> one such block's


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
