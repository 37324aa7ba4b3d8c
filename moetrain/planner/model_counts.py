"""What the config's model counts of itself, built on the meta device: its training FLOPs per
token (the model's own count, as MFU's), its parameters (total, and active: what one token
multiplies with), and the trunk blocks pipeline stages are cut from."""

from __future__ import annotations


def trunk_block_count(cfg) -> int:
    """The blocks pipeline stages are cut from (moetrain.parallelisms.pipeline_split)."""
    from moetrain.build.model import meta_model
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.pipeline_split import trunk_blocks

    spec = get_model_spec(cfg.model.name)
    return len(trunk_blocks(meta_model(spec, cfg.model.args), spec.plan))


def flops_per_token(cfg) -> float:
    """Training FLOPs per token of the config's model (the model's own count, as MFU's; its
    split by kind of kernel, where the model gives one, in `.by_kind`)."""
    from moetrain.build.model import meta_model
    from moetrain.models import get_model_spec

    spec = get_model_spec(cfg.model.name)
    return spec.flops_per_token(meta_model(spec, cfg.model.args), cfg.data.seq_len)


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
