"""Activation checkpointing of the plan's blocks (`train.activation_checkpoint`).

- `none`: autograd keeps every activation a block's backward needs.
- `full`: a block keeps only its inputs; backward runs its whole forward again (a replay)
  to rebuild the rest. The replay moves data like the forward: the EP dispatch and combine
  all-to-alls and the ring attention's transfers run again (and `a2a_bytes` counts them).
- `selective`: a block keeps what the full forward keeps, except in its recomputed regions
  (moetrain/models/common/recompute.py): its norms, SwiGLU's `silu(gate) * up` and the attention's
  inputs after the projections (DeepSeek-V3: the MLA up-projections and RoPE; Qwen3: the
  per-head norms and RoPE). Backward rebuilds a region's activations from its kept inputs
  when an op needs them. Regions hold no communication and no state, so this composes with
  the split backward of ZBVZeroBubble and DualPipeV: the input pass rebuilds what it needs
  (the attention kernel's q, k, v), the weight pass what it needs (a projection's input),
  each from the same kept inputs. Nothing is replayed: routers run once, nothing is re-sent.

Recomputation is invisible (docs/overview.md, "Principles"); each piece of state, by construction:

- parameter names: a block's `forward` is replaced by one that runs the original under
  `torch.utils.checkpoint` (`full`) or inside `selective_block()` (`selective`): an
  instance attribute, no wrapper module, so FQNs, checkpoint keys and HF names do not
  change. Module hooks stay outside the checkpointed region: a
  block's FSDP hooks (all-gather, reshard) run around it in the forward and are not part
  of the replay, which calls the original forward directly.
The rest concerns `full`'s replay (`selective` replays no block):

- routers' assignment counts (the aux-loss-free bias update and its load): the replay runs
  inside `moetrain.models.common.replay.replay()`, and routers count only forwards that are not
  replays. The statistics a forward returns (aux losses, expert-load metrics) come from
  the first run only: a replay's outputs go nowhere but into the rebuilt activations.
- the EP dispatcher's pending stack: a replay runs to the end of the block (no early stop),
  so every dispatch it repeats is combined in it: one push, one pop, inside the backward
  of that block, while no forward is in flight.
- bytes sent: the replay's all-to-alls and ring transfers are counted like the forward's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext

from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.models.common.recompute import selective_block
from moetrain.models.common.replay import replay

MODES = ("none", "full", "selective")


@contextmanager
def _replaying(*contexts) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(replay())
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _full_contexts():
    return nullcontext(), _replaying()


def apply_activation_checkpointing(blocks: list[tuple[str, nn.Module]], mode: str) -> None:
    """Checkpoint each of `blocks` ((fqn, module) of the plan's `blocks`) in place, before
    FSDP. `mode`: one of MODES."""
    if mode not in MODES:
        raise ValueError(f"unknown activation_checkpoint mode {mode!r}; use one of {MODES}")
    if mode == "none":
        return
    for _, block in blocks:
        block.forward = (_checkpointed if mode == "full" else _selective)(block.forward)


def _selective(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with selective_block():
            return forward(*args, **kwargs)

    return run


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # NOTE: early_stop=False: a replay always finishes the block's forward, so that each
        # dispatch it repeats is also combined (the dispatcher's pending stack stays
        # paired). The RNG state is restored for the replay (no model
        # here draws random numbers in forward; one with dropout would need it).
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=_full_contexts,
            early_stop=False,
            preserve_rng_state=True,
            **kwargs,
        )

    return run
