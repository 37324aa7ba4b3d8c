"""A causal LM as three parts around its blocks, so that it can run whole or in stages.

    h = model.embed(input_ids)                                   # first stage only
    extra = model.block_inputs(h, position_ids, document_ids)    # every stage
    for block in blocks:  h, stats = block(h, *extra)            # a stage's slice of them
    logits, mtp_logits, head_stats = model.head(h, extra, ...)   # last stage only

A model's `forward` is `causal_lm_forward` over all its blocks; a pipeline stage
(`parallelisms.pipeline`) runs the same parts over its own slice, with hidden states
in and out, so both compute the same arithmetic. `block_inputs` must depend only on
what every stage receives (the hidden states' dtype and device, positions, document
ids), never on the embedding's output values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.common.balance_losses import stack_stats
from models.common.moe import RouterStats
from models.common.output import CausalLMOutput
from models.common.rope import rope_cos_sin


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


class DecoderLM(nn.Module):
    """The parts of a decoder LM made of `embed_tokens` -> `layers` -> `norm` -> `lm_head`
    (None: the head reuses `embed_tokens.weight`, a tied embedding), with RoPE over
    `rope_dim` dims of each head (`yarn`: its YaRN scaling, None for plain RoPE). A model
    sets those attributes (and `args.rope_theta`) in its constructor; one with more in
    its head (MTP) overrides `head`."""

    rope_dim: int
    yarn: Any = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, S]; position_ids [B, S] (default 0..S-1, the true positions when the
        sequence is split or reordered); document_ids [B, S]: a token attends only to its
        own document (None: to every earlier token)."""
        return causal_lm_forward(self, self.layers, input_ids, position_ids, document_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [B, S, hidden]

    def block_inputs(
        self, h: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor | None
    ) -> tuple[Any, ...]:
        theta = self.args.rope_theta
        cos, sin = rope_cos_sin(position_ids, self.rope_dim, theta, h.dtype, self.yarn)
        return cos, sin, document_ids

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [B, S, hidden] -> logits [B, S, vocab]."""
        weight = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        return F.linear(h, weight)

    def head(
        self, h: torch.Tensor, extra: tuple[Any, ...], mtp_input_ids: torch.Tensor | None = None
    ) -> HeadOutput:
        return HeadOutput(self.logits(self.norm(h)))
