"""One micro-batch's activations on the meta device (`trace_step`), with the repeated
blocks thinned before tracing and added back by extrapolation (`sample_blocks`): what a
rank's forward leaves for its backward, at its peak with the gradients, by block
structure, and of it the routed rows (`moetrain.planner.traces` runs it per layout; the
instruments are `moetrain.planner.meta_trace`'s).

The model is the plain one (no FSDP, EP or ring): at the rank's local shapes (micro-batch
x seq_len / cp) and balanced routing its saved activations are those of the parallel model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from moetrain.models.common.replay import is_replay
from moetrain.parallelisms.plan import match_modules
from moetrain.planner.meta_trace import (
    FusedAttention,
    StorageTimeline,
    live_curve,
    storage_bytes,
)


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
    # of saved_after_forward, the bytes of the routed rows (born in the dispatch, the experts
    # and the routed sum, alive at their block's end): what grows with a rank's share of the
    # routing (all layers)
    saved_rows: int = 0
    # block_structure -> what one such block's forward leaves for its backward (pipeline_stages)
    saved_by_structure: dict = field(default_factory=dict, repr=False, compare=False)
    rows_by_structure: dict = field(default_factory=dict, repr=False, compare=False)  # of it
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
    per_block: dict[int, list[int]] = {}  # id(block) -> [saved, routed, kv, kv_fp32, rows]
    current: list[list[int]] = [[0, 0, 0, 0, 0]]  # the bucket of the block running now
    row_serials: list[int] = []  # storages born inside the routed modules (dispatch, experts, sum)
    row_from: list[int] = []  # the open routed modules' first serial
    rows_start: dict[int, int] = {}  # id(block) -> len(row_serials) at its forward's start

    def rows_in(_module, _args):
        if not is_replay():
            row_from.append(len(timeline.spans))

    def rows_out(_module, _args, _out):
        if not is_replay():
            row_serials.extend(range(row_from.pop(), len(timeline.spans)))

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
            current.append(per_block.setdefault(id(block), [-timeline.live_bytes(), 0, 0, 0, 0]))
            rows_start[id(block)] = len(row_serials)

    forward_done: dict[int, int] = {}  # id(block) -> op at the end of its forward
    backward_from: dict[int, int] = {}  # id(block) -> op when its output's gradient is in

    def after_block(block, _args, out):
        if not is_replay():
            timeline.poll()
            bucket = current.pop()
            bucket[0] += timeline.live_bytes()
            mine = row_serials[rows_start[id(block)] :]  # its rows still alive: saved
            bucket[4] += sum(timeline.spans[i][0] for i in mine if timeline.spans[i][2] < 0)
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
    for pattern in (plan.routed_permute, plan.routed_experts, plan.routed_sum):
        for _, m in match_modules(model, pattern or (), "routed rows", required=False):
            hooks.append(m.register_forward_pre_hook(rows_in))
            hooks.append(m.register_forward_hook(rows_out))
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
    trace.routed, trace.kv, trace.kv_fp32, trace.saved_rows = totals[1:]
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
        trace.saved_rows += extra[4]
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
    by_structure: dict[tuple, list[list[int]]] = {}
    for _, block in match_modules(model, plan.blocks, "blocks"):
        if id(block) in per_block:
            by_structure.setdefault(block_structure(block), []).append(per_block[id(block)])
    mean = lambda v, i: sum(b[i] for b in v) / len(v)  # noqa: E731
    trace.saved_by_structure = {k: mean(v, 0) for k, v in by_structure.items()}
    trace.rows_by_structure = {k: mean(v, 4) for k, v in by_structure.items()}
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
