"""A layout's trace: one micro-batch of the plain model run on the meta device at a rank's
local shapes, under a checkpointing mode (`trace_layout`); what it depends on within one
search (`trace_key`). A search runs most of them in worker processes
(`moetrain.planner.workers`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from moetrain.models.common.recompute import rebuilding
from moetrain.parallelisms.plan import match_modules


def trace_key(cfg, dims, mode: str) -> tuple:
    """What a trace depends on within one search: the rank's local shapes and the mode."""
    return (cfg.train.micro_batch_size, dims.cp, mode)


def trace_layout(cfg, spec, dims, mode: str, meshes, models=None):
    """One micro-batch of the plain model at this rank's local shapes, with `mode`, priced
    at no gradient bytes (`StepTrace.at_grad_bytes` prices a layout's); `models`: a
    `shards.Measured` that keeps the sampled meta model between calls."""
    import torch

    from moetrain.build.model import meta_model
    from moetrain.data.batch import Batch
    from moetrain.loop import losses
    from moetrain.models.common.moe import MoEOptions
    from moetrain.parallelisms.activation_checkpoint import apply_activation_checkpointing
    from moetrain.parallelisms.plan import match_modules
    from moetrain.planner.activation_trace import sample_blocks, trace_step
    from moetrain.planner.meta_trace import MetaShortcuts, use_fused_attention
    from moetrain.planner.shards import param_dtype as compute_dtype

    param_dtype = compute_dtype(cfg)

    def build():
        # NOTE: the grouped GEMM (not the per-expert loop, which reads sizes on the host)
        # and no capacity drops: what meta tensors can run; under balanced routing the
        # same rows reach the experts.
        options = MoEOptions(gemm="grouped_mm", z_loss=cfg.moe.z_loss_coef > 0)
        model = meta_model(spec, cfg.model.args, cfg.peft, options)
        model.to(param_dtype)
        for _, m in match_modules(model, spec.plan.fp32_modules, "fp32", required=False):
            m.float()
        model.train()
        return model, sample_blocks(model, spec.plan)

    key = (
        "trace",
        cfg.model.name,
        repr(cfg.model.args),
        repr(cfg.peft),
        cfg.moe.z_loss_coef > 0,
        param_dtype,
    )
    model, sampled = models.copy_of(key, build) if models is not None else build()
    use_fused_attention(model, spec.plan)  # before checkpointing: the replay runs it too
    apply_activation_checkpointing(match_modules(model, spec.plan.blocks, "blocks"), mode)
    terms = spec.loss_terms(cfg.model.args)
    S = cfg.data.seq_len // dims.cp
    grad_accum = dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    scope = losses.LossScope(
        dims,
        meshes.world.get_group("cp"),
        cfg.train.global_batch_size,
        grad_accum,
        torch.device("meta"),
    )
    step_loss = losses.StepLoss(terms, losses.BalanceTerms.of(cfg.moe), scope)

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
    if mode == "selective":
        # What its backward computes again (recompute_cost). NOTE: a pass of its own, on one
        # sequence (the FLOPs are per token): the counter's bookkeeping must not reach the
        # trace above.
        counter = RebuiltFlops(model, spec.plan)
        with MetaShortcuts(), counter:
            step_of(1)(lambda: None)
        trace.gemm_flops = counter.per_token(sampled, S)
    return trace


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """x [N, K] by stacked w [E, K, M] (each row by its expert's), or x^T [K, N] by g [N, M]
    (each expert's rows summed: the weight gradient): 2 N K M either way."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _kind(op) -> str:
    # the kinds of moetrain.models.common.flops.KINDS: a dense GEMM (mm, addmm, bmm), the experts'
    # grouped GEMM or an attention kernel
    if "_grouped_mm" in str(op):
        return "grouped"
    return "attention" if "attention" in str(op) else "dense"


class RebuiltFlops(TorchDispatchMode):
    """A dispatch mode: the FLOPs of the matrix products and attention kernels that run while
    backward rebuilds a recomputed region (`moetrain.models.common.recompute.rebuilding`), by kind,
    in all and per block (the block holding the module whose region it is).

    NOTE: not the difference of a `selective` and a `none` trace under torch's
    `FlopCounterMode`: its module tracking in backward charges a block's ops to whichever
    modules it holds open then (the experts' backward GEMMs went to the embedding), so a
    difference by block missed the experts' recomputed down-projection."""

    def __init__(self, model, plan) -> None:
        super().__init__()
        blocks = match_modules(model, plan.blocks, "blocks")
        self.outer_blocks = [
            b for f, b in blocks if not any(f.startswith(g + ".") for g, _ in blocks)
        ]
        self.block_of = {id(m): id(b) for b in self.outer_blocks for m in b.modules()}
        grouped = {torch.ops.aten._grouped_mm: shape_wrapper(_grouped_mm_flops)}
        self.registry = {**flop_registry, **grouped}
        self.total: dict[str, float] = {}
        self.per_block: dict[int, dict[str, float]] = {id(b): {} for b in self.outer_blocks}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner = rebuilding()
        formula = self.registry.get(func._overloadpacket)
        if owner is not None and formula is not None:
            flops, kind = formula(*args, **kwargs, out_val=out), _kind(func)
            self.total[kind] = self.total.get(kind, 0.0) + flops
            block = self.block_of.get(id(owner))
            if block is not None:
                self.per_block[block][kind] = self.per_block[block].get(kind, 0.0) + flops
        return out

    def per_token(self, sampled, tokens: int):
        """-> `recompute_cost.GemmFlops` per token: per block structure, and for the whole
        model with what `activation_trace.sample_blocks` dropped added back (`sampled`), as the
        trace adds its bytes."""
        from moetrain.planner.activation_trace import block_structure
        from moetrain.planner.recompute_cost import GemmFlops

        def mean(ids: list[int]) -> dict[str, float]:
            kinds = {k for i in ids for k in self.per_block[i]}
            return {k: sum(self.per_block[i].get(k, 0.0) for i in ids) / len(ids) for k in kinds}

        groups: dict[tuple, list[int]] = {}
        for b in self.outer_blocks:
            groups.setdefault(block_structure(b), []).append(id(b))
        total = dict(self.total)
        for kept, dropped in sampled:
            for k, f in mean([id(b) for b in kept if id(b) in self.per_block]).items():
                total[k] = total.get(k, 0.0) + dropped * f
        by_structure = {
            s: {k: f / tokens for k, f in mean(ids).items()} for s, ids in groups.items()
        }
        return GemmFlops({k: f / tokens for k, f in total.items()}, by_structure)
