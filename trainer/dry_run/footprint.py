"""What one rank holds and moves per step, measured without memory: the dry-run planner's
instruments (`python -m trainer.dry_run`).

- State (`sharded_state`): the model is built on the meta device and the real plan is
  applied over a fake process group, so every local shard has the shape a real run gives
  it. Parameters and gradients are FSDP2's padded shards (one size on every rank); the
  optimizer state is what the real optimizer creates for the unpadded local shards,
  computed for every rank from the DTensor placements.
- Activations (`trace_step`): one micro-batch's forward, loss and backward run on the meta
  device under a dispatch mode that follows every storage from its creation to its death,
  with the block's real activation checkpointing. The model is the plain one (no FSDP, EP
  or ring): at the rank's local shapes (micro-batch x seq_len / cp) and balanced routing
  its saved activations are those of the parallel model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.common.replay import is_replay
from parallelisms.plan import match_modules


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def local_numel_by_rank(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """[world_size] int64: elements of `p`'s local shard on each rank (torch.chunk split of
    every sharded dim, as DTensor does; the last ranks get the short or empty chunks)."""
    if not isinstance(p, DTensor):
        return torch.full((world_size,), p.numel(), dtype=torch.int64)
    ranks = p.device_mesh.mesh  # [mesh dims] -> global rank
    sizes = [torch.full(ranks.shape, s, dtype=torch.int64) for s in p.shape]
    for i, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            n = ranks.shape[i]
            coord = torch.arange(n).view([n if j == i else 1 for j in range(ranks.dim())])
            size = sizes[placement.dim]
            chunk = (size + n - 1) // n
            sizes[placement.dim] = (size - coord * chunk).clamp(min=0).minimum(chunk)
    numel = math.prod(sizes) if sizes else torch.ones(ranks.shape, dtype=torch.int64)
    out = torch.zeros(world_size, dtype=torch.int64)
    out[ranks.flatten()] = torch.broadcast_to(numel, ranks.shape).flatten()
    return out


@dataclass
class ShardedState:
    """Per-rank bytes of the resting training state (lists indexed by global rank)."""

    params: list[int]
    grads: list[int]
    optimizer: list[int]


def sharded_state(
    optimizer: torch.optim.Optimizer, world_size: int, weight: dict[int, float] | None = None
) -> ShardedState:
    """Parameter, gradient and optimizer bytes of every rank, from this rank's meta shards
    (the parameters of `optimizer`, a real optimizer over the parallelized meta model).

    Parameters: the storages FSDP2 allocated (every shard padded to the largest, so one
    size on every rank). Gradients: FSDP2 writes them as views of each unit's padded
    reduce-scatter output, in the parameters' dtype: the same bytes. Optimizer: the same
    optimizer class, with the same groups, initialises its state on the meta local
    shards; a state tensor shaped like the shard scales with each rank's unpadded shard,
    any other is counted as is. `weight` (id of a parameter -> factor, default 1): how
    many times a parameter counts, for the blocks `sample_blocks` stands in for.
    """
    weight = weight or {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    padded = sum(
        weight.get(id(p), 1.0) * _local(p).untyped_storage().nbytes() for p in params
    )  # FSDP2 gives every parameter its own padded storage
    local = {id(p): nn.Parameter(torch.empty_like(_local(p))) for p in params}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [local[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    opt = type(optimizer)(groups)
    for q in local.values():
        q.grad = torch.zeros_like(q)
    opt.step()  # meta tensors: initialises the state, computes nothing
    per_rank = torch.zeros(world_size, dtype=torch.float64)
    for p in params:
        q, w = local[id(p)], weight.get(id(p), 1.0)
        for value in opt.state[q].values():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == q.shape and value.numel():
                per_rank += local_numel_by_rank(p, world_size) * value.element_size() * w
            else:
                per_rank += value.untyped_storage().nbytes() * w
    padded = round(padded)
    return ShardedState(
        [padded] * world_size, [padded] * world_size, per_rank.round().long().tolist()
    )


# --- activations ------------------------------------------------------------------------


class _StorageTimeline(TorchDispatchMode):
    """Every storage an op creates, with the op index of its creation and of its death
    (polled after each op: a storage dies when its last tensor does)."""

    def __init__(self, resting: set[int]) -> None:
        super().__init__()
        self.resting = resting  # parameters and buffers: not activations
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # cdata -> (ref, serial)
        self.spans: list[list[int]] = []  # serial -> [nbytes, born, died (-1: alive)]
        self.op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _meta_op(func, args, kwargs or {})
        self.op += 1
        self._poll()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata in self.resting or s._cdata in self.live:
                    continue
                self.live[s._cdata] = (StorageWeakRef(s), len(self.spans))
                self.spans.append([s.nbytes(), self.op, -1])
        return out

    def _poll(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.spans[self.live.pop(k)[1]][2] = self.op

    def live_bytes(self) -> int:
        return sum(self.spans[serial][0] for _, serial in self.live.values())

    def serial(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(t.untyped_storage()._cdata)
        return None if entry is None else entry[1]


def _meta_op(func, args, kwargs):
    # NOTE: the grouped GEMM's meta kernel takes bf16 only; the shapes do not depend on the
    # dtype, so an fp32 product is shaped by its bf16 twin. Not `moetrain::grouped_mm`
    # (the compile path): the trace runs the op a real run runs, the one `selective` keeps.
    if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
        low = [
            a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        ]
        return torch.empty_like(func(*low, **kwargs), dtype=args[0].dtype)
    return func(*args, **kwargs)


class _FusedAttention(TorchFunctionMode):
    """SDPA as a fused kernel on the meta device. NOTE: on meta, SDPA decomposes into its
    math path, which saves the [S, S] scores; the CPU and CUDA kernels a run uses save only
    q, k, v, the output and the log-sum-exp. The fused CPU kernel's meta form has that
    footprint (and takes GQA and masks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        kwargs.pop("enable_gqa", None)
        dv = v.shape[-1]
        if dv != q.shape[-1]:  # the fused kernels want one head dim: pad V (as MLA code does)
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            kwargs.pop("dropout_p", 0.0),
            kwargs.pop("is_causal", False),
            attn_mask=kwargs.pop("attn_mask", None),
            scale=kwargs.pop("scale", None),
        )
        return out[0][..., :dv]


class _FusedCore(nn.Module):
    """An attention core run under `_FusedAttention` from inside its own forward, so that
    an activation-checkpointing replay (which does not see the tracer's torch-function
    mode) takes the fused path too."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(self, *args, **kwargs):
        with _FusedAttention():
            return self.core(*args, **kwargs)


def use_fused_attention(model: nn.Module, plan) -> None:
    """Swap the plan's attention cores of a meta model for `_FusedCore`s (in place)."""
    if plan.attention_core is not None:
        for fqn, core in match_modules(model, plan.attention_core, "attention_core"):
            model.set_submodule(fqn, _FusedCore(core))


def sample_blocks(model: nn.Module, plan, keep: int = 2) -> list[tuple[list[nn.Module], int]]:
    """Drop repeated blocks from a meta model before tracing (in place): of the plan's
    blocks with the same structure (class, parameter names and shapes) the first `keep`
    stay; the trace adds the others' saved activations by extrapolation. Returns, per
    structure, (the kept blocks, how many were dropped).

    NOTE: a structure's blocks save the same bytes at the same local shapes, and the peak
    of a step comes after every block's forward (the loss, or backward), when all their
    saved activations are alive; so a dropped block adds its kept twins' mean saving.
    Only blocks held in a ModuleList are dropped; others are traced as they are."""
    groups: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for fqn, block in match_modules(model, plan.blocks, "blocks"):
        shape = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        groups.setdefault((type(block).__name__, shape), []).append((fqn, block))
    drop: dict[str, set[int]] = {}  # parent ModuleList fqn -> indices to drop
    out = []
    for members in groups.values():
        dropped = 0
        for fqn, _ in members[keep:]:
            parent, _, index = fqn.rpartition(".")
            container = model.get_submodule(parent) if parent else model
            if isinstance(container, nn.ModuleList) and index.isdigit():
                drop.setdefault(parent, set()).add(int(index))
                dropped += 1
        out.append(([b for _, b in members[:keep]], dropped))
    for parent, indices in drop.items():
        container = model.get_submodule(parent)
        kept = [m for i, m in enumerate(container) if i not in indices]
        model.set_submodule(parent, nn.ModuleList(kept))
    return out


@dataclass
class StepTrace:
    """One micro-batch's forward + loss + backward on one rank, in bytes."""

    peak: int = 0  # activations and this rank's gradients, at their highest point together
    activations: int = 0  # activations alone, at their highest point
    saved_after_forward: int = 0  # what the forward leaves for the backward
    routed: int = 0  # bytes of the (token, expert) rows the routed experts take (all layers)
    experts: int = 0  # routed experts of a MoE layer, and the experts a token takes
    top_k: int = 0
    kv: int = 0  # bytes of K and V entering the attention cores (all layers)
    kv_fp32: int = 0  # the same elements in fp32 (the dK/dV sums the ring passes on)


def trace_step(
    model: nn.Module,
    plan,
    run_step,
    sharded_grad_bytes: int,
    sampled: list[tuple[list[nn.Module], int]] = (),
) -> StepTrace:
    """Run `run_step(mark_forward_end)` (forward, loss, backward of one micro-batch on meta
    inputs) under the storage timeline. The plain model's gradients are scaled to this
    rank's sharded ones (`sharded_grad_bytes`). The peak is over op boundaries: the
    activations alive plus the gradients written so far. `sampled`: what
    `sample_blocks` dropped, added back by extrapolation."""
    resting = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    timeline = _StorageTimeline(resting)
    trace = StepTrace()
    per_block: dict[int, list[int]] = {}  # id(block) -> [saved, routed, kv, kv_fp32]
    current: list[list[int]] = [[0, 0, 0, 0]]  # the bucket of the block running now

    def on_experts(_module, args):
        if not is_replay():  # a `full` replay routes the same rows again: count them once
            x, tokens_per_expert, token_of = args[:3]  # (RoutedExperts.forward)
            current[-1][1] += token_of.numel() * x[0].numel() * x.element_size()
            trace.experts = max(trace.experts, tokens_per_expert.numel())
            trace.top_k = max(trace.top_k, token_of.numel() // max(1, len(x)))

    def on_core(_module, args):
        if not is_replay():
            k, v = args[1], args[2]
            current[-1][2] += k.numel() * k.element_size() + v.numel() * v.element_size()
            current[-1][3] += 4 * (k.numel() + v.numel())

    def before_block(block, _args):
        if not is_replay():
            timeline._poll()
            current.append(per_block.setdefault(id(block), [-timeline.live_bytes(), 0, 0, 0]))

    def after_block(block, _args, _out):
        if not is_replay():
            timeline._poll()
            current.pop()[0] += timeline.live_bytes()

    hooks = []
    if plan.routed_experts is not None:
        for _, m in match_modules(model, plan.routed_experts, "routed_experts"):
            hooks.append(m.register_forward_pre_hook(on_experts))
    if plan.attention_core is not None:
        for _, m in match_modules(model, plan.attention_core, "attention_core"):
            hooks.append(m.register_forward_pre_hook(on_core))  # (the _FusedCore if swapped)
    for _, block in match_modules(model, plan.blocks, "blocks"):
        hooks.append(block.register_forward_pre_hook(before_block))
        hooks.append(block.register_forward_hook(after_block))
    forward_end: list[int] = []
    try:
        with _FusedAttention(), timeline:
            run_step(lambda: forward_end.append(timeline.op))
            timeline._poll()
    finally:
        for h in hooks:
            h.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_scale = sharded_grad_bytes / max(1, storage_bytes(grads))
    grad_serials = {timeline.serial(g) for g in grads}
    at = forward_end[0] if forward_end else 0
    trace.peak, trace.saved_after_forward = _peak(timeline.spans, grad_serials, grad_scale, at)
    trace.activations, _ = _peak(timeline.spans, grad_serials, 0.0, at)
    totals = [sum(col) for col in zip(*per_block.values(), current[0], strict=False)]
    trace.routed, trace.kv, trace.kv_fp32 = totals[1:]
    for blocks, dropped in sampled:  # what sample_blocks dropped: its kept twins' mean
        mean = [sum(col) / len(blocks) for col in zip(*(per_block[id(b)] for b in blocks))]
        extra = [int(x * dropped) for x in mean]
        trace.peak += extra[0]
        trace.activations += extra[0]
        trace.saved_after_forward += extra[0]
        trace.routed += extra[1]
        trace.kv += extra[2]
        trace.kv_fp32 += extra[3]
    return trace


def _peak(spans, grad_serials, grad_scale, at) -> tuple[int, int]:
    """(max over ops of live activations + scaled gradients, activations live at op `at`)."""
    ops = 1 + max((max(b, d) for _, b, d in spans), default=0)
    delta = [0.0] * (ops + 1)
    saved = 0
    for serial, (nbytes, born, died) in enumerate(spans):
        weight = grad_scale if serial in grad_serials else 1.0
        end = ops if died < 0 else died
        delta[born] += weight * nbytes
        delta[end] -= weight * nbytes
        if serial not in grad_serials and born <= at < end:
            saved += nbytes
    live = peak = 0.0
    for d in delta:
        live += d
        peak = max(peak, live)
    return int(peak), saved
