"""What the config's model counts of itself, built on the meta device: its training FLOPs per
token as its kernels execute them (the model's own count, MFU's, with causal attention at
what the kernels run of it, and the GEMMs `train.fp8` runs in FP8), its parameters (total,
and active: what one token multiplies with; the main model and its MTP module apart), and
the trunk blocks pipeline stages are cut from."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.flops import FlopsPerToken
from moetrain.planner.step_cost import QUANTISE_BYTES


def trunk_block_count(cfg) -> int:
    """The blocks pipeline stages are cut from (moetrain.parallelisms.pipeline_split)."""
    from moetrain.build.model import meta_model
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.pipeline_split import trunk_blocks

    spec = get_model_spec(cfg.model.name)
    return len(trunk_blocks(meta_model(spec, cfg.model.args), spec.plan))


def flops_per_token(cfg) -> ExecutedFlops:
    """Training FLOPs per token of the config's model as its kernels execute them: the
    model's own count (MFU's; its split by kind of kernel in `.by_kind`) with causal
    attention at what the kernels run of it, and its FP8-eligible GEMMs (`ExecutedFlops`)."""
    from moetrain.build.model import meta_model
    from moetrain.models import get_model_spec

    spec = get_model_spec(cfg.model.name)
    model = meta_model(spec, cfg.model.args)
    counted = spec.flops_per_token(model, cfg.data.seq_len)
    return executed(counted, model, spec.plan, cfg.data.seq_len)


def parameter_counts(cfg) -> dict:
    """{"total": every parameter of the config's model, "active": those one token uses, the
    routed experts at top_k / num_experts of their size (`moetrain.models.common.flops.active_params`,
    the input embedding counted: a token reads its row)}; LoRA's adapters are not counted.
    A model with MTP depths (head modules that hold blocks of their own) also gets "main"
    (the model without them, what published counts give: DeepSeek-V3's 671B / 37B) and
    "mtp" (the depths), each {"total", "active"}."""
    from moetrain.build.model import meta_model
    from moetrain.models import get_model_spec
    from moetrain.models.common.flops import active_params

    spec = get_model_spec(cfg.model.name)
    model = meta_model(spec, cfg.model.args)
    total = sum(p.numel() for p in model.parameters())
    counts = {"total": total, "active": round(active_params(model, None))}
    mtp = _mtp_modules(model, spec.plan)
    if mtp:
        part = {
            "total": sum(p.numel() for m in mtp for p in m.parameters()),
            "active": round(sum(active_params(m, None) for m in mtp)),
        }
        counts["main"] = {k: counts[k] - part[k] for k in part}
        counts["mtp"] = part
    return counts


def _mtp_modules(model, plan) -> list:
    """The head's modules that hold blocks of their own: the MTP depths (docs/models.md)."""
    from moetrain.parallelisms.plan import match_modules

    heads = match_modules(model, plan.head, "head", required=False)
    blocks = [f for f, _ in match_modules(model, plan.blocks, "blocks")]
    return [m for f, m in heads if any(b.startswith(f + ".") for b in blocks)]


# --- what the kernels execute --------------------------------------------------------------

# The key/query block of the causal attention kernels: FlashAttention's and FlexAttention's
# 128 (CUDA's memory-efficient kernel, MLA's, takes 64: its fraction below is within 1%).
CAUSAL_TILE = 128


def causal_fraction(seq_len: int, tile: int = CAUSAL_TILE) -> float:
    """Of the full S x S score product, what a causal kernel executes: it skips the tiles
    wholly above the diagonal and computes the diagonal ones whole, n (n + 1) / 2 of n^2
    tiles with n = S / tile (4096: 33 / 64 = 0.516; one tile: all of it)."""
    n = max(1, -(-seq_len // tile))
    return (n + 1) / (2 * n)


@dataclass(frozen=True)
class GemmCounts:
    """The GEMMs `train.fp8` runs in FP8 (the blocks' linears but the fp32 routers: attention
    projections, dense MLPs, shared experts; and the routed experts), per token, and what
    quantising their inputs moves (`quantise_bytes`)."""

    fp8_flops: float  # training FLOPs per token of those GEMMs (routed ones at top_k / E)
    # bytes per token through memory to quantise their activation inputs: each GEMM of a
    # linear's three (forward, input and weight gradient) quantises both of its inputs, so
    # x and dy twice each; a pass reads the bf16 tensor for its amax (2 bytes an element),
    # then again to scale and cast it (2) and writes the fp8 copy (1): 5 bytes an element
    quantise_bytes: float
    dense_weights: int  # elements of the dense FP8 weights (all of the model's)
    routed_weights: int  # elements of the routed experts' weights (all experts)


def gemm_counts(model, plan) -> GemmCounts:
    """GemmCounts of a meta `model` with parallel plan `plan`."""
    from moetrain.parallelisms.plan import match_modules

    routers = fp32_modules(model, plan)
    parts = [_block_gemms(b, routers) for _, b in match_modules(model, plan.blocks, "blocks")]
    flops, nbytes, dense, routed = (sum(col) for col in zip(*parts, strict=True))
    return GemmCounts(flops, nbytes, dense, routed)


def fp32_modules(model, plan) -> set[int]:
    """ids of the plan's fp32 modules (the routers), which stay out of FP8."""
    from moetrain.parallelisms.plan import match_modules

    return {id(m) for _, m in match_modules(model, plan.fp32_modules, "fp32", required=False)}


def fp8_flops_of(block, routers: set[int]) -> float:
    """Training FLOPs per token of `block`'s FP8 GEMMs (GemmCounts.fp8_flops)."""
    return _block_gemms(block, routers)[0]


def _block_gemms(block, routers: set[int]) -> tuple[float, float, int, int]:
    """(FLOPs, quantise bytes per token, dense and routed weight elements) of one block's
    FP8 GEMMs; `routers`: `fp32_modules`."""
    from torch import nn

    from moetrain.models.common.moe import MoE

    flops = nbytes = 0.0
    dense = routed = 0
    for m in block.modules():
        if isinstance(m, nn.Linear) and id(m) not in routers:
            dense += m.weight.numel()
            flops += 6.0 * m.weight.numel()
            nbytes += 2 * QUANTISE_BYTES * (m.in_features + m.out_features)
        elif isinstance(m, MoE):
            share = m.top_k / m.num_experts
            for p in m.experts.parameters():  # stacked [E, in, out] (or [E, out, in])
                routed += p.numel()
                flops += 6.0 * p.numel() * share
                nbytes += 2 * QUANTISE_BYTES * m.top_k * (p.shape[-1] + p.shape[-2])
    return flops, nbytes, dense, routed


class ExecutedFlops(FlopsPerToken):
    """The model's FLOPs per token as the kernels execute them: its count (`spec.
    flops_per_token`, MFU's) with the causal attention at `causal` of the full product,
    and the GEMMs `train.fp8` would run in FP8 (`gemms`)."""

    causal: float
    gemms: GemmCounts

    def __new__(cls, counted: FlopsPerToken, causal: float, gemms: GemmCounts) -> ExecutedFlops:
        attention = counted.by_kind["attention"]
        by_kind = {**counted.by_kind, "attention": attention * causal}
        total = float(counted) - attention * (1 - causal)
        out = super().__new__(cls, total, by_kind, counted.shared_experts)
        out.causal, out.gemms = causal, gemms
        return out


def executed(counted: FlopsPerToken, model, plan, seq_len: int) -> ExecutedFlops:
    """`counted` (a spec's count for `model`) as executed at `seq_len` (`ExecutedFlops`)."""
    return ExecutedFlops(counted, causal_fraction(seq_len), gemm_counts(model, plan))
