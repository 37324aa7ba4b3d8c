"""Activation checkpointing of the plan's blocks (`train.activation_checkpoint`).

- `none`: autograd keeps every activation a block's backward needs.
- `full`: a block keeps only its inputs; backward runs its whole forward again (a replay)
  to rebuild the rest. The replay moves data like the forward: the EP dispatch and combine
  all-to-alls and the ring attention's transfers run again (and `a2a_bytes` counts them).
- `selective`: a block also keeps the outputs of the ops that are expensive to recompute
  and cheap to keep: communication (the EP all-to-alls, ring attention), attention kernels
  and matrix products (projections, routers, the experts' grouped GEMMs). The replay gets
  those back instead of running them and recomputes only the cheap rest (norms,
  activations, RoPE, routing, permutations): it sends nothing.

Recomputation is invisible (docs/overview.md, "Principles"); each piece of state, by construction:

- parameter names: a block's `forward` is replaced by one that runs the original under
  `torch.utils.checkpoint` (an instance attribute; no wrapper module), so FQNs, checkpoint
  keys and HF names do not change. Module hooks stay outside the checkpointed region: a
  block's FSDP hooks (all-gather, reshard) run around it in the forward and are not part
  of the replay, which calls the original forward directly.
- routers' assignment counts (the aux-loss-free bias update and its load): the replay runs
  inside `models.common.replay.replay()`, and routers count only forwards that are not
  replays. The statistics a forward returns (aux losses, expert-load metrics) come from
  the first run only: a replay's outputs go nowhere but into the rebuilt activations.
- the EP dispatcher's pending stack: a replay runs to the end of the block (no early stop),
  so every dispatch it repeats is combined in it: one push, one pop, inside the backward
  of that block, while no forward is in flight.
- bytes sent and collectives: under `selective` the all-to-all and the ring are single
  ops (`moetrain::all_to_all`, `moetrain::ring_attention`) whose outputs are kept; the
  replay gets them without running the op's body, which is where data moves and bytes are
  counted. The split sizes follow: they are read from the kept counts exchange.

NOTE: why not torch's `create_selective_checkpoint_contexts`: it pairs *every* op call of
the replay with the forward's by position and refuses any extra one. Inside a block, the
experts' own FSDP unit runs its hooks in both runs, but not identically (in backward it
claims the replay as its forward root and records `FSDP::root_pre_forward`, a profiler
op). `_Keep`/`_Reuse` below pair only the kept ops, per op in call order, and check that
each pair has the same input shapes.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

import models.common.flex  # noqa: F401  (registers moetrain::flex_attention)
import parallelisms.all_to_all  # noqa: F401  (registers moetrain::all_to_all)
import parallelisms.context_parallel  # noqa: F401  (registers moetrain::ring_attention)
from models.common.replay import replay

MODES = ("none", "full", "selective")


def kept_ops() -> frozenset:
    """The ops whose outputs `selective` keeps. Not kept: element-wise ops, norms, softmax,
    indexing; nor `bmm`, whose large instance is the [S, S] score matrix of SDPA's math
    path (cheap to recompute for its size)."""
    aten, ours = torch.ops.aten, torch.ops.moetrain
    return frozenset(
        {
            ours.all_to_all.default,  # EP dispatch, combine and their counts exchange
            ours.ring_attention.default,  # CP
            ours.flex_attention.default,  # masked attention on CUDA (models/common/flex.py)
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten.mm.default,  # nn.Linear / F.linear, and the per-expert loop's products
            aten.addmm.default,
            aten._grouped_mm.default,  # the experts' grouped GEMMs
        }
    )


def _inputs(args) -> tuple:
    return tuple((t.shape, t.dtype) for t in tree_leaves(args) if isinstance(t, torch.Tensor))


def _versions(out) -> list[int]:
    return [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Keep(TorchDispatchMode):
    """The forward of a block under `selective`: every op runs; the outputs of the ops in
    `keep` are also put aside, per op in call order."""

    def __init__(self, kept: dict, keep: frozenset) -> None:
        super().__init__()
        self.kept, self.keep = kept, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.keep:
            self.kept.setdefault(func, deque()).append((_inputs(args), out, _versions(out)))
        return out


class _Reuse(TorchDispatchMode):
    """The replay of that forward: a kept op hands back the forward's output instead of
    running (no compute, no transfer, no byte count); every other op runs.

    NOTE: pairing is by call order per op, so code that runs in the forward only (a
    router's counting) must not call kept ops; a mismatch is refused, not misread.
    """

    def __init__(self, kept: dict, keep: frozenset) -> None:
        super().__init__()
        self.kept, self.keep = kept, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.keep:
            return func(*args, **(kwargs or {}))
        queue = self.kept.get(func)
        if not queue:
            raise RuntimeError(f"activation checkpoint: the replay ran {func} more often")
        inputs, out, versions = queue.popleft()
        if inputs != _inputs(args) or versions != _versions(out):
            raise RuntimeError(
                f"activation checkpoint: the {func} kept in forward does not fit the replay "
                "(other input shapes, or the kept output was modified in place)"
            )
        # A fresh alias without autograd history: the replay's autograd records its own.
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)

    def __exit__(self, *exc):
        left = {str(f): len(q) for f, q in self.kept.items() if q}
        self.kept.clear()  # what the replay took is free now; a failed replay frees the rest
        result = super().__exit__(*exc)
        if left and exc[0] is None:
            raise RuntimeError(f"activation checkpoint: the replay skipped kept ops {left}")
        return result


@contextmanager
def _replaying(*contexts) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(replay())
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _full_contexts():
    return nullcontext(), _replaying()


def _selective_contexts(keep: frozenset):
    kept: dict = {}  # this forward's kept outputs, until its replay takes them
    return _Keep(kept, keep), _replaying(_Reuse(kept, keep))


def apply_activation_checkpointing(blocks: list[tuple[str, nn.Module]], mode: str) -> None:
    """Checkpoint each of `blocks` ((fqn, module) of the plan's `blocks`) in place, before
    FSDP. `mode`: one of MODES."""
    if mode not in MODES:
        raise ValueError(f"unknown activation_checkpoint mode {mode!r}; use one of {MODES}")
    if mode == "none":
        return
    if mode == "full":
        context_fn = _full_contexts
    else:
        context_fn = functools.partial(_selective_contexts, kept_ops())
    for _, block in blocks:
        block.forward = _checkpointed(block.forward, context_fn)


def _checkpointed(forward, context_fn):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # NOTE: early_stop=False: a replay always finishes the block's forward, so that each
        # dispatch it repeats is also combined (the dispatcher's pending stack stays paired)
        # and every kept output is taken. The RNG state is restored for the replay (no model
        # here draws random numbers in forward; one with dropout would need it).
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            early_stop=False,
            preserve_rng_state=True,
            **kwargs,
        )

    return run
