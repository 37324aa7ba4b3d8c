"""What one rank holds and moves per step, measured without memory (`moetrain.planner`).

- State (`sharded_state`): the model is built on the meta device and the real plan applied
  over a fake process group, so every local shard has the shape a real run gives it.
  Parameters and gradients are FSDP2's padded shards (one size on every rank); the optimizer
  state is what the real optimizer creates for the unpadded local shards, for every rank.
- Update (`update_transient`): the temporaries of the gradient norm, clipping and the
  optimizer step, measured by running them on meta copies of the rank's local shards.
- Activations (`trace_step`): one micro-batch's forward, loss and backward run on the meta
  device under a dispatch mode that follows every storage from its creation to its death,
  with the block's real activation checkpointing. The model is the plain one (no FSDP, EP
  or ring): at the rank's local shapes (micro-batch x seq_len / cp) and balanced routing
  its saved activations are those of the parallel model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves

from moetrain.models.common.replay import is_replay
from moetrain.parallelisms.plan import match_modules
from moetrain.planner.meta_trace import (
    FusedAttention,
    MetaShortcuts,
    StorageTimeline,
    live_curve,
    local_tensor,
    storage_bytes,
)


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
    update: list[int]  # the temporaries of the norm, clip and optimizer step, above the rest
    frozen: list[int]  # the part of params that does not train (LoRA's base)


def sharded_state(
    optimizer: torch.optim.Optimizer | None,
    world_size: int,
    weight: dict[int, float] | None = None,
    frozen: list[nn.Parameter] = (),
    moment_bytes: int | None = None,  # the moments' bytes per element (optimizer_state_dtype)
) -> ShardedState:
    """Parameter, gradient and optimizer bytes of every rank, from this rank's meta shards
    (the parameters of `optimizer`, a real optimizer over the parallelized meta model).

    Parameters: the storages FSDP2 allocated (every shard padded to the largest, so one
    size on every rank). Gradients: FSDP2 writes them as views of each unit's padded
    reduce-scatter output, in the parameters' dtype: the same bytes. Optimizer: the same
    optimizer class, with the same groups, initialises its state on the meta local
    shards; a state tensor shaped like the shard scales with each rank's unpadded shard,
    any other is counted as is. `weight` (id of a parameter -> factor, default 1): how
    many times a parameter counts, for the blocks `sample_blocks` stands in for. Update:
    `update_transient`, scaled to each rank's unpadded shards as the state is. `frozen`:
    parameters outside the optimizer (LoRA's base): their shards (in the params, and
    apart), no gradient. `optimizer` None: nothing trains, only `frozen` counts."""
    weight = weight or {}
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []

    def storage(tensors) -> float:  # FSDP2 gives every parameter its own padded storage
        return sum(
            weight.get(id(p), 1.0) * local_tensor(p).untyped_storage().nbytes() for p in tensors
        )

    padded, frozen_bytes = storage(params), round(storage(frozen))
    held = [frozen_bytes] * world_size
    if optimizer is None:  # e.g. a pipeline stage's embedding under LoRA, measured alone
        none = [0] * world_size
        return ShardedState(held, none, none, none, held)
    local = {id(p): nn.Parameter(torch.empty_like(local_tensor(p))) for p in params}
    groups = [
        {**_on_meta(g), "params": [local[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    opt = type(optimizer)(groups)
    for q in local.values():
        q.grad = torch.zeros_like(q)
    with MetaShortcuts():
        opt.step()  # meta tensors: initialises the state, computes nothing
    per_rank = torch.zeros(world_size, dtype=torch.float64)
    for p in params:
        q, w = local[id(p)], weight.get(id(p), 1.0)
        for value in opt.state[q].values():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == q.shape and value.numel():
                size = min(value.element_size(), moment_bytes or 8)  # as the run keeps them
                per_rank += local_numel_by_rank(p, world_size) * size * w
            else:
                per_rank += value.untyped_storage().nbytes() * w
    padded = round(padded)
    update = update_transient(optimizer, weight) * per_rank / per_rank[0].clamp(min=1)
    return ShardedState(
        [padded + frozen_bytes] * world_size,
        [padded] * world_size,
        per_rank.round().long().tolist(),
        update.round().long().tolist(),
        held,
    )


def _on_meta(group: dict) -> dict:
    """A group's settings but its parameters, for a copy on meta: foreach (no fused on meta)."""
    rest = {k: v for k, v in group.items() if k != "params"}
    if rest.get("fused"):
        rest.update(fused=None, foreach=True)
    return rest


def update_transient(optimizer: torch.optim.Optimizer, weight: dict[int, float]) -> int:
    """The bytes the update allocates above this rank's parameters, gradients and optimizer
    state at its highest point: the real gradient norm and clipping (`moetrain.parallelisms.clip`)
    and the real optimizer's step, in the trainer's order, on meta copies of this rank's
    local shards, once the state exists.

    NOTE: AdamW's foreach step allocates, per parameter group, a list shaped like the group
    (the second moment's square root, in the state's dtype): with the 2-D weights in one
    group, one more fp32 copy of the rank's parameters while the gradients are alive
    (Qwen3-30B-A3B's 4-block proxy on one H100 peaked there, 58.1 GiB). The fused step
    works in place, so it is not run (torch has no fused kernel on meta); the norm and
    clipping allocate scalars. A parameter that counts `weight` times (`sample_blocks`)
    counts int(weight) times and once more for the fraction left.

    NOTE: what the update allocates depends on each group's bytes per dtype (the foreach
    lists), not on how the bytes are cut into tensors; so each group runs as flat tensors of its largest shard's size
    holding its bytes, not one copy per parameter and sampled block (DeepSeek-V3 on 2,048
    ranks: the same bytes, 0.7 s instead of 4.1 s per layout)."""
    from moetrain.parallelisms.clip import clip_grads_, grad_norm

    groups = []
    for g in optimizer.param_groups:
        elements: dict[torch.dtype, list[int]] = {}  # dtype -> [total, largest]
        for p in g["params"]:
            shard, w = local_tensor(p), weight.get(id(p), 1.0)
            n = shard.numel()
            count = elements.setdefault(shard.dtype, [0, 0])
            count[0] += n * int(w) + round((w - int(w)) * n)
            count[1] = max(count[1], n)
        copies = []
        for dtype, (total, largest) in elements.items():
            whole, rest = divmod(total, max(1, largest))
            copies += [torch.empty(largest, dtype=dtype, device="meta") for _ in range(whole)]
            if rest:
                copies.append(torch.empty(rest, dtype=dtype, device="meta"))
        groups.append({**_on_meta(g), "params": [nn.Parameter(c) for c in copies]})
    opt = type(optimizer)(groups)
    params = [q for g in opt.param_groups for q in g["params"]]
    for q in params:
        q.grad = torch.zeros_like(q)
    with MetaShortcuts():
        opt.step()  # creates the state, which rests from then on like params and gradients
    resting = [*params, *(q.grad for q in params), *tree_leaves(list(opt.state.values()))]
    timeline = StorageTimeline(
        {t.untyped_storage()._cdata for t in resting if isinstance(t, torch.Tensor)}
    )
    with timeline:
        clip_grads_(params, 1.0, grad_norm(params))
        if not any(g.get("fused") for g in optimizer.param_groups):
            opt.step()
        timeline.poll()
    return int(max(live_curve(timeline.spans, set(), 1.0)))


# --- activations ------------------------------------------------------------------------


def sample_blocks(model: nn.Module, plan, keep: int = 2) -> list[tuple[list[nn.Module], int]]:
    """Drop repeated blocks from a meta model before tracing (in place): of the plan's
    blocks with the same structure (class, parameter names and shapes) the first `keep`
    stay; the trace adds the others' saved activations by extrapolation. Returns, per
    structure, (the kept blocks, how many were dropped).

    NOTE: a structure's blocks save the same bytes and take the same gradients at the same
    local shapes, so a dropped block adds its kept twins' mean of each, at the time it
    would hold them (`trace_step`). Only blocks held in a ModuleList (or, in a pipeline
    stage, a ModuleDict) are dropped; others are traced as they are."""
    groups: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for fqn, block in match_modules(model, plan.blocks, "blocks"):
        groups.setdefault(block_structure(block), []).append((fqn, block))
    drop: dict[str, set[str]] = {}  # parent ModuleList/ModuleDict fqn -> names to drop
    out = []
    for members in groups.values():
        dropped = 0
        for fqn, _ in members[keep:]:
            parent, _, name = fqn.rpartition(".")
            container = model.get_submodule(parent) if parent else model
            # a pipeline stage's blocks sit in a ModuleDict under their model indices
            if isinstance(container, nn.ModuleDict | nn.ModuleList) and name.isdigit():
                drop.setdefault(parent, set()).add(name)
                dropped += 1
        out.append(([b for _, b in members[:keep]], dropped))
    for parent, names in drop.items():
        container = model.get_submodule(parent)
        if isinstance(container, nn.ModuleDict):
            for name in names:
                del container[name]
        else:
            kept = [m for i, m in enumerate(container) if str(i) not in names]
            model.set_submodule(parent, nn.ModuleList(kept))
    return out


def block_structure(block: nn.Module) -> tuple:
    """What makes two blocks twins: their class and their parameters' names and shapes."""
    shape = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
    return (type(block).__name__, shape)


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
    # block_structure -> what one such block's forward leaves for its backward (pipeline_stages)
    saved_by_structure: dict = field(default_factory=dict, repr=False, compare=False)
    gemm_flops: object = None  # recompute_cost.GemmFlops (`none` and `selective` traces)
    # What `peak` was computed from, so another rank's gradient bytes re-price it
    # (`at_grad_bytes`) without tracing again: the storage spans, which of them are
    # gradients, the dropped blocks' windows, and the plain model's gradient bytes.
    curve: tuple = field(default=(), repr=False, compare=False)

    def at_grad_bytes(self, sharded_grad_bytes: int) -> StepTrace:
        """This trace with the gradients scaled to `sharded_grad_bytes` (a layout whose
        shards differ but whose micro-batch, local sequence and mode are the same)."""
        spans, grad_serials, mirrored, plain_grads = self.curve
        peak = _highest(spans, grad_serials, mirrored, sharded_grad_bytes / max(1, plain_grads))
        return replace(self, peak=peak)


def _highest(spans, grad_serials, mirrored, scale: float) -> int:
    """Live activations + gradients x `scale`, at their peak; `mirrored`: the dropped
    blocks' backward windows (trace_step)."""
    live = live_curve(spans, grad_serials, scale)
    peak = max(live, default=0.0)
    for start, end, dropped, saved, grad in mirrored:
        window = max(live[start : max(end, start + 1)])
        peak = max(peak, window + dropped * max(0.0, saved - grad * scale))
    return int(peak)


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
    `sample_blocks` dropped, added back by extrapolation at the time they would live.

    NOTE: a structure's dropped blocks stood after its last kept one. So their saved
    activations (the kept twins' mean) live from the end of that block's forward until
    the start of its backward (the gradient reaching its output), and their gradients from
    then on. Adding the saved bytes to the peak wherever it falls would count them at the
    end of backward too, where a step without checkpointing peaks on its gradients while
    every activation is freed (Qwen3-30B-A3B, 4 blocks: +1.8 GiB)."""
    resting = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    timeline = StorageTimeline(resting)
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
            timeline.poll()
            current.append(per_block.setdefault(id(block), [-timeline.live_bytes(), 0, 0, 0]))

    forward_done: dict[int, int] = {}  # id(block) -> op at the end of its forward
    backward_from: dict[int, int] = {}  # id(block) -> op when its output's gradient is in

    def after_block(block, _args, out):
        if not is_replay():
            timeline.poll()
            current.pop()[0] += timeline.live_bytes()
            forward_done[id(block)] = timeline.op

            def turned(_grad) -> None:  # the hidden state's gradient starts the block's backward
                backward_from.setdefault(id(block), timeline.op)

            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                first.register_hook(turned)

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
        with FusedAttention(), timeline:
            run_step(lambda: forward_end.append(timeline.op))
            timeline.poll()
    finally:
        for h in hooks:
            h.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_serials = {timeline.serial(g) for g in grads}
    plain_grads = storage_bytes(grads)
    spans = list(timeline.spans)
    totals = [sum(col) for col in zip(*per_block.values(), current[0], strict=False)]
    trace.routed, trace.kv, trace.kv_fp32 = totals[1:]
    # A dropped block's own backward is its last kept twin's, [start, end) in ops. The first
    # of them runs while the twin and the other dropped blocks still hold their saved
    # activations, and none of them has its gradients yet: the twin's window plus
    # `dropped` x (saved - gradients); the later ones, fewer of each.
    mirrored = []  # (start, end, dropped, one block's saved, one block's plain gradients)
    for blocks, dropped in sampled:  # what sample_blocks dropped: its kept twins' mean
        if not dropped:
            continue
        mean = [sum(col) / len(blocks) for col in zip(*(per_block[id(b)] for b in blocks))]
        extra = [int(x * dropped) for x in mean]
        trace.routed += extra[1]
        trace.kv += extra[2]
        trace.kv_fp32 += extra[3]
        last = id(blocks[-1])
        turn = backward_from.get(last, timeline.op)
        spans.append([extra[0], forward_done[last], turn])  # their saved activations
        twin = [p.grad for b in blocks for p in b.parameters() if p.grad is not None]
        grad_mean = storage_bytes(twin) // len(blocks)
        grad_serials.add(len(spans))
        spans.append([grad_mean * dropped, turn, -1])  # their gradients, from their backward on
        plain_grads += grad_mean * dropped
        end = min((t for t in backward_from.values() if t > turn), default=timeline.op)
        mirrored.append((turn, end, dropped, mean[0], grad_mean))
    by_structure: dict[tuple, list[int]] = {}
    for _, block in match_modules(model, plan.blocks, "blocks"):
        if id(block) in per_block:
            by_structure.setdefault(block_structure(block), []).append(per_block[id(block)][0])
    trace.saved_by_structure = {k: sum(v) / len(v) for k, v in by_structure.items()}
    at = forward_end[0] if forward_end else 0
    trace.curve = (spans, grad_serials, mirrored, plain_grads)
    trace.activations = _highest(spans, grad_serials, mirrored, 0.0)
    trace.peak = trace.at_grad_bytes(sharded_grad_bytes).peak
    trace.saved_after_forward = sum(
        n
        for i, (n, born, died) in enumerate(spans)
        if i not in grad_serials and born <= at and (died < 0 or at < died)
    )
    return trace
