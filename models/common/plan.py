"""Declarative parallel plan: what a model tells the parallelism code about itself.

Pure data (FQN patterns, `*` matches one name component), so models never import
`parallelisms/`. `parallelisms.plan` applies it and refuses patterns that match nothing.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelPlan:
    # Repeated blocks: one FSDP unit each, chained for prefetch in this order.
    blocks: str
    # Routed-expert modules (stacked [E, ...] weights): EP on dim 0, FSDP on dim 1.
    routed_experts: str | None = None
    # Attention cores (models.common.attention.AttentionCore): context parallelism runs
    # them as a ring.
    attention_core: str | None = None
    # Modules whose parameters stay fp32 under bf16 mixed precision (e.g. routers).
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)
