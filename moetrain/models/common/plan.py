"""Declarative parallel plan: what a model tells the parallelism code about itself.

Pure data (FQN patterns, `*` matches one name component), so models never import
`moetrain/parallelisms/`. A field may hold several patterns (a tuple): their matches are taken in
order. At every launch, `moetrain.parallelisms.plan.check_plan` refuses a pattern that matches no
module (unless `optional`) and a seam field that leaves a module of its type unnamed.
"""

from dataclasses import dataclass, field

Patterns = str | tuple[str, ...]


@dataclass(frozen=True)
class ParallelPlan:
    # Repeated blocks: one FSDP unit each, chained for prefetch in this order; the unit of
    # activation checkpointing.
    blocks: Patterns
    # Routed-expert modules (stacked [E, ...] weights): EP on dim 0, FSDP on dim 1.
    routed_experts: Patterns | None = None
    # The modules the routed tokens leave from (moetrain.models.common.moe.Permute), one per
    # routed-experts match and in the same order: EP starts the dispatch there.
    routed_permute: Patterns | None = None
    # The modules that sum each token's routed rows (moetrain.models.common.moe.Unpermute), one per
    # routed-experts match and in the same order: EP waits there for the combine in flight.
    routed_sum: Patterns | None = None
    # Attention cores (moetrain.models.common.attention.AttentionCore): context parallelism runs
    # them as a ring.
    attention_core: Patterns | None = None
    # Shared experts (dense MLPs every token goes through): LoRA's `shared_experts` target.
    shared_experts: Patterns | None = None
    # Modules whose parameters stay fp32 under bf16 mixed precision (e.g. routers).
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)
    # Pipeline stages (parallel.pp): the modules the model's `embed` uses, on the first
    # stage, and those its `head` uses (final norm, output head, MTP), on the last; blocks
    # inside a head module run there too, the others are cut into stages
    # (moetrain/models/common/staged.py).
    embedding: Patterns = "embed_tokens"
    head: Patterns = ("norm", "lm_head")
    # Patterns that some configurations of the model do not build (a tied model's lm_head,
    # DeepSeek-V3 without MTP modules): they, and the patterns under them, may match
    # nothing. Every other pattern must match a module (moetrain.parallelisms.plan.check_plan).
    optional: tuple[str, ...] = ("lm_head",)
