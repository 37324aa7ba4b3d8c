"""`DecoderLM`: the scaffolding every model family shares, so that a family's class holds
only what differs (its blocks, the dims RoPE turns, a head of its own, what its init
leaves at zero).

    embed_tokens -> layers (the family's blocks) -> norm (RMSNorm) -> lm_head

- `lm_head` is None for a tied embedding: the head's matmul reuses `embed_tokens.weight`
  instead of sharing one Parameter between two modules, which meta-device materialisation
  would untie. A family with another head (ERNIE-4.5's bias on a tied head) overrides
  `output_head` and `logits`.
- The staged parts (`moetrain.models.common.staged`): `embed`, `block_inputs` (RoPE's cos and sin
  over `rope_dim` dims of each head, YaRN-scaled by `yarn`), `head`; `forward` composes them.
- Init: Hugging Face's for decoder LMs (`moetrain.models.common.weight_init.normal_init_`): RMSNorm weights
  1, the leaves named in `zero_leaves` 0, every other weight N(0, initializer_range), token
  embeddings N(0, embedding_init_std) when it is set. A tensor's value depends only on the
  seed, its name and its global shape, so every layout initialises the same model.

The args fields it reads are those every family's args have: `vocab_size`, `hidden_size`,
`rms_norm_eps`, `tie_word_embeddings`, `rope_theta`, `initializer_range`,
`embedding_init_std`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.common.norm import RMSNorm
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.common.rope import rope_cos_sin
from moetrain.models.common.staged import HeadOutput, causal_lm_forward
from moetrain.models.common.weight_init import init_all_, normal_init_

# The routing state of bias-balanced routers (the aux-loss-free correction bias and the
# token counts it is updated from) starts at zero, as biases do.
ROUTING_STATE = ("e_score_correction_bias", "tokens_per_expert")


class DecoderLM(nn.Module):
    """A decoder LM of `blocks` with RoPE over `rope_dim` dims of each head (`yarn`: its
    YaRN scaling, None for plain RoPE)."""

    # Leaf names (the last part of a parameter's or buffer's name) that init to zero.
    zero_leaves: tuple[str, ...] = ("bias",)

    def __init__(
        self, args: Any, blocks: Iterable[nn.Module], rope_dim: int, yarn: Any = None
    ) -> None:
        super().__init__()
        self.args, self.rope_dim, self.yarn = args, rope_dim, yarn
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = self.output_head(args)

    def output_head(self, args: Any) -> nn.Module | None:
        """The output projection's module; None: tied to the embedding."""
        if args.tie_word_embeddings:
            return None
        return nn.Linear(args.hidden_size, args.vocab_size, bias=False)

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

    # ---- the parts a pipeline stage runs (moetrain/models/common/staged.py) -------------------
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

    # ---- initialisation -------------------------------------------------------------
    def reset_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """Fill `tensor` (the full, unsharded value of parameter or buffer `name`, or one
        tile of it) with its init. Taking the tensor as an argument lets the trainer
        initialise each global tensor identically on any parallel layout."""
        args = self.args
        normal_init_(
            self,
            name,
            tensor,
            args.initializer_range,
            generator,
            self.zero_leaves,
            args.embedding_init_std,
        )

    def init_weights(self, seed: int = 0) -> None:
        """Initialise every (unsharded) parameter and buffer from `seed`."""
        init_all_(self, seed)
