"""A layout's trace: one micro-batch of the plain model run on the meta device at a rank's
local shapes, under a checkpointing mode (`trace_layout`); what it depends on within one
search (`trace_key`). A search runs most of them in worker processes
(`trainer.dry_run.workers`).
"""

from __future__ import annotations


def trace_key(cfg, dims, mode: str) -> tuple:
    """What a trace depends on within one search: the rank's local shapes and the mode."""
    return (cfg.train.micro_batch_size, dims.cp, mode)


def trace_layout(cfg, spec, dims, mode: str, meshes, models=None):
    """One micro-batch of the plain model at this rank's local shapes, with `mode`, priced
    at no gradient bytes (`StepTrace.at_grad_bytes` prices a layout's); `models`: a
    `shards.Measured` that keeps the sampled meta model between calls."""
    import torch

    from models.common.moe import MoEOptions
    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from parallelisms.plan import match_modules
    from trainer.data.batch import Batch
    from trainer.dry_run.footprint import sample_blocks, trace_step
    from trainer.dry_run.meta_trace import MetaShortcuts, use_fused_attention
    from trainer.dry_run.shards import param_dtype as compute_dtype
    from trainer.loop import losses
    from trainer.loop.peft import apply_lora

    param_dtype = compute_dtype(cfg)

    def build():
        with torch.device("meta"):
            # NOTE: the grouped GEMM (not the per-expert loop, which reads sizes on the
            # host) and no capacity drops: what meta tensors can run; under balanced
            # routing the same rows reach the experts.
            options = MoEOptions(gemm="grouped_mm", z_loss=cfg.moe.z_loss_coef > 0)
            model = spec.build(cfg.model.args, options)
            if cfg.peft.method == "lora":
                apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
        model.to(param_dtype)
        for _, m in match_modules(model, spec.plan.fp32_modules, "fp32", required=False):
            m.float()
        model.train()
        return model, sample_blocks(model, spec.plan)

    key = ("trace", cfg.model.name, repr(cfg.model.args), repr(cfg.peft), cfg.moe.z_loss_coef > 0, param_dtype)  # fmt: skip
    model, sampled = models.copy_of(key, build) if models is not None else build()
    use_fused_attention(model, spec.plan)  # before checkpointing: the replay runs it too
    apply_activation_checkpointing(match_modules(model, spec.plan.blocks, "blocks"), mode)
    terms = spec.loss_terms(cfg.model.args)
    S = cfg.data.seq_len // dims.cp
    grad_accum = dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    step_loss = losses.StepLoss(
        terms, losses.BalanceTerms.of(cfg.moe), dims, meshes.world.get_group("cp"),
        cfg.train.global_batch_size, grad_accum, torch.device("meta"),
    )  # fmt: skip

    def step_of(B: int):  # one micro-batch of B sequences: forward, loss, backward
        ids = torch.zeros(B, S, dtype=torch.long, device="meta")
        positions = torch.arange(S, device="meta")[None].expand(B, S)
        batch = Batch(ids, ids, positions, ids)
        if terms.mtp_depth:
            batch = losses.with_mtp_targets(batch, terms.mtp_depth)

        def run_step(mark_forward_end) -> None:
            step_loss.start(losses.GlobalCounts(B * S, B * S, 0, [B * S] * terms.mtp_depth))
            inputs = losses.model_inputs(batch, terms, cfg.data.document_mask)
            # NOTE: `out` held through the backward, as `Trainer.forward_backward` holds it:
            # its logits ([B, S, vocab] in the compute dtype) outlive the loss's use of them
            out = model(batch.input_ids, batch.position_ids, **inputs)
            loss = step_loss(out, batch)
            mark_forward_end()
            loss.backward()

        return run_step

    trace = trace_step(model, spec.plan, step_of(cfg.train.micro_batch_size), 0, sampled)
    if mode in ("none", "selective"):
        # their difference is what `selective` computes again (recompute_cost). NOTE: a
        # pass of its own, on one sequence (the FLOPs are per token): the counter's module
        # hooks hold gradients a little longer, which the trace above must not see.
        counter = flop_counter()
        with MetaShortcuts(), counter:
            step_of(1)(lambda: None)
        trace.gemm_flops = gemm_flops(counter, model, spec.plan, sampled, S)
    return trace


def flop_counter():
    """A `FlopCounterMode` that prints nothing: what `gemm_flops` reads."""
    from torch.utils.flop_counter import FlopCounterMode

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


def gemm_flops(counter, model, plan, sampled, tokens: int):
    """The counts of `counter` (which ran one micro-batch of `tokens` tokens through the
    plain `model`) per token, per block structure, and for the whole model with what
    `footprint.sample_blocks` dropped added back (`sampled`), as the trace adds its bytes:
    a `recompute_cost.GemmFlops`."""
    from parallelisms.plan import match_modules
    from trainer.dry_run.footprint import block_structure
    from trainer.dry_run.recompute_cost import GemmFlops

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
