"""The pre-norm residual decoder block both model families share."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.moe import RouterStats
from moetrain.models.common.norm import RMSNorm


class DecoderBlock(nn.Module):
    """h = h + self_attn(norm(h), cos, sin, document_ids); h = h + mlp(norm(h)).

    `mlp` is a dense MLP or an MoE layer, which also returns its routing statistics. The
    child names are Hugging Face's, so checkpoint keys map one to one. `document_ids`
    [B, S] (or None) reaches the attention core: the document mask of packed samples.
    """

    def __init__(self, dim: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = mlp

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterStats | None]:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, document_ids)
        ffn_out = self.mlp(self.post_attention_layernorm(h))
        stats = None
        if isinstance(ffn_out, tuple):
            ffn_out, stats = ffn_out
        return h + ffn_out, stats
