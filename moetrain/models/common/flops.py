"""Training FLOPs per token (for MFU): 6 x the parameters a token uses, plus attention.

A model's spec calls `training_flops_per_token` with the facts only it knows (its
attention shape, whether its input embedding is a separate matrix from its head).
The count it returns also says how it splits by kind of kernel (`FlopsPerToken.by_kind`),
for the planner's step-time model, whose efficiency differs by kind
(`moetrain.planner.step_cost`, `benchmarks/gemm_rates.py`).
"""

from __future__ import annotations

from torch import nn

from moetrain.models.common.moe import MoE

# dense: every matmul of a weight all tokens use (projections, dense and shared MLPs, routers,
# head); grouped: the routed experts' grouped GEMMs; attention: the scores and their use.
KINDS = ("dense", "grouped", "attention")


class FlopsPerToken(float):
    """A float (what MFU divides by) that also carries its split by kind of kernel.

    NOTE: a float subclass, so that every spec's `flops_per_token` passes the split on
    unchanged and every caller that wants the number alone still gets one."""

    by_kind: dict[str, float]
    # Of "dense", the shared experts' (what a MoE layer runs while its combine is in flight:
    # the planner's overlap credit, `moetrain.planner.a2a_cost.a2a_hidden`).
    shared_experts: float

    def __new__(
        cls, total: float, by_kind: dict[str, float], shared_experts: float = 0.0
    ) -> FlopsPerToken:
        out = super().__new__(cls, total)
        out.by_kind = dict(by_kind)
        out.shared_experts = shared_experts
        return out


def _routed(model: nn.Module) -> tuple[float, float]:
    """(the routed experts' parameters, the share of them one token multiplies with:
    top_k / num_experts of each layer's)."""
    every = share = 0.0
    for module in model.modules():
        if isinstance(module, MoE):
            n = sum(p.numel() for p in module.experts.parameters())
            every += n
            share += n * module.top_k / module.num_experts
    return every, share


def routed_params(model: nn.Module) -> float:
    """The routed experts' parameters one token multiplies with."""
    return _routed(model)[1]


def active_params(model: nn.Module, input_embedding: nn.Module | None) -> float:
    """Parameters one token multiplies with: routed experts count top_k / num_experts of
    their size; `input_embedding` (a lookup, not a matmul) is left out. Pass None for an
    embedding tied to the head: its one matrix is counted once, as the head's matmul."""
    every, share = _routed(model)
    total = float(sum(p.numel() for p in model.parameters())) - every + share
    if input_embedding is not None:
        total -= sum(p.numel() for p in input_embedding.parameters())
    return total


def training_flops_per_token(
    model: nn.Module,
    seq_len: int,
    *,
    attention_layers: int,
    heads: int,
    qk_dim: int,
    v_dim: int,
    input_embedding: nn.Module | None,
) -> FlopsPerToken:
    """6 * active params + 6 * seq * heads * (qk dim + v dim) per attention layer (the
    scores and their use, forward + backward; causal masking not discounted, as usual)."""
    attention = 6 * attention_layers * heads * (qk_dim + v_dim) * seq_len
    matmuls = 6 * active_params(model, input_embedding)
    grouped = 6 * routed_params(model)
    split = {"dense": matmuls - grouped, "grouped": grouped, "attention": attention}
    shared = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, MoE) and m.shared_experts is not None
        for p in m.shared_experts.parameters()
    )
    return FlopsPerToken(matmuls + attention, split, 6.0 * shared)


def with_head_passes(flops: FlopsPerToken, head: nn.Module, passes: int) -> FlopsPerToken:
    """`flops` plus `passes` more passes per token through the output `head` (its matmul,
    forward and backward: 6 x its parameters, a dense kernel): DeepSeek-V3's MTP depths each
    project their hidden state through the shared head again."""
    extra = 6.0 * passes * sum(p.numel() for p in head.parameters())
    split = {**flops.by_kind, "dense": flops.by_kind["dense"] + extra}
    return FlopsPerToken(float(flops) + extra, split, flops.shared_experts)
