"""What `train.activation_checkpoint = "selective"` computes again in backward
(`moetrain.planner.step_cost.estimate` adds it to a step's compute; docs/planner.md,
"Step-time model"), from the FLOPs the trace measured (a costs-layer file: figures in,
FLOPs out; the counting itself is `moetrain.planner.traces.RebuiltFlops`).

The planner's `selective` trace (`moetrain.planner.traces.trace_layout`) runs one sequence
again with a dispatch mode that counts the matrix products and attention kernels run while
backward rebuilds a recomputed region (`moetrain/models/common/recompute.py`), charged to the block
whose module the region belongs to: DeepSeek-V3's MLA up-projections, 2 x (q_b_proj +
kv_b_proj parameters) per token and layer, and every MoE layer's routed experts'
down-projection, top-k x 2 x dim x hidden. Element-wise work (norms, SwiGLU's product,
RoPE) is not counted, as the step-time model counts none elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GemmFlops:
    """What a `selective` trace computed again, per token of it."""

    total: dict[str, float]  # kind -> the whole model's (dropped blocks added back)
    by_structure: dict  # activation_trace.block_structure -> kind -> one such block's


def _again(activations: dict) -> GemmFlops:
    try:
        return activations["selective"].gemm_flops
    except KeyError:  # measure_layout measures every mode unless told fewer
        raise ValueError(
            "the selective recomputation's FLOPs are measured from the `selective` trace; "
            "this layout has none"
        ) from None


def recomputed_per_token(activations: dict) -> dict[str, float]:
    """kind -> FLOPs per token `selective` runs again, the whole model's; `activations`:
    a layout's traces by mode (`layout_cost.Layout.activations`)."""
    return {k: f for k, f in _again(activations).total.items() if f > 0}


def recomputed_by_structure(activations: dict) -> dict:
    """block structure -> FLOPs per token `selective` runs again in one such block."""
    return {s: sum(kinds.values()) for s, kinds in _again(activations).by_structure.items()}
