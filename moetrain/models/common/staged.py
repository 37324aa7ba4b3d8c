"""A causal LM as three parts around its blocks, so that it can run whole or in stages.

    h = model.embed(input_ids)                                   # first stage only
    extra = model.block_inputs(h, position_ids, document_ids)    # every stage
    for block in blocks:  h, stats = block(h, *extra)            # a stage's slice of them
    logits, mtp_logits, head_stats = model.head(h, extra, ...)   # last stage only

A model's `forward` is `causal_lm_forward` over all its blocks; a pipeline stage
(`moetrain.parallelisms.pipeline`) runs the same parts over its own slice, with hidden states
in and out, so both compute the same arithmetic. `block_inputs` must depend only on
what every stage receives (the hidden states' dtype and device, positions, document
ids), never on the embedding's output values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from moetrain.models.common.balance_losses import stack_stats
from moetrain.models.common.moe import RouterStats
from moetrain.models.common.output import CausalLMOutput


class HeadOutput(NamedTuple):
    logits: torch.Tensor  # [B, S, vocab]
    mtp_logits: list[torch.Tensor] | None = None  # one [B, S, vocab] per MTP depth
    stats: list[RouterStats] = []  # routing statistics of MoE layers inside the head (MTP)


class StagedLM(Protocol):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> hidden states [B, S, hidden]."""
        ...

    def block_inputs(
        self, h: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor | None
    ) -> tuple[Any, ...]:
        """What every block takes after the hidden states (e.g. RoPE's cos and sin)."""
        ...

    def head(
        self, h: torch.Tensor, extra: tuple[Any, ...], mtp_input_ids: torch.Tensor | None = None
    ) -> HeadOutput:
        """The last block's hidden states -> logits (final norm, output head, MTP)."""
        ...


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """0..S-1 for every row of input_ids [B, S]."""
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    return position_ids.expand_as(input_ids)


def run_blocks(
    blocks: Iterable[nn.Module], h: torch.Tensor, extra: tuple[Any, ...]
) -> tuple[torch.Tensor, list[RouterStats]]:
    """Run `blocks` in order; the routing statistics of those that route (MoE layers)."""
    stats: list[RouterStats] = []
    for block in blocks:
        h, block_stats = block(h, *extra)
        if block_stats is not None:
            stats.append(block_stats)
    return h, stats


def causal_lm_forward(
    model: StagedLM,
    blocks: Iterable[nn.Module],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    mtp_input_ids: torch.Tensor | None = None,
) -> CausalLMOutput:
    """The whole model: embed, every block, head."""
    if position_ids is None:
        position_ids = default_positions(input_ids)
    h = model.embed(input_ids)
    extra = model.block_inputs(h, position_ids, document_ids)
    h, stats = run_blocks(blocks, h, extra)
    out = model.head(h, extra, mtp_input_ids)
    stats = stats + list(out.stats)
    return CausalLMOutput(out.logits, stack_stats(stats) if stats else None, out.mtp_logits)
