"""Qwen3-MoE (Hugging Face `Qwen3MoeForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + ffn(norm(h))   # ffn: MoE or dense SwiGLU
    logits = head(norm(h))

Parameter names mirror Hugging Face's without the leading "model." so the adapter in
hf.py stays a thin renaming, except for the stacked expert weights.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import DecoderLM
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter
from moetrain.models.common.norm import RMSNorm
from moetrain.models.common.recompute import recomputed
from moetrain.models.common.rope import apply_rope, yarn_of
from moetrain.models.qwen3_moe.args import Qwen3MoeArgs


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        d, bias = args.head_dim, args.attention_bias
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(args.num_attention_heads * d, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.core = AttentionCore(scale=d**-0.5, causal=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hq, D]
        k = self.k_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        v = self.v_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        # one region: under `selective` recomputation the kernel's saved q, k are rebuilt
        # in backward from the projections (moetrain/models/common/recompute.py)
        q, k = recomputed(self._norm_rope, q, k, cos, sin)
        return self.o_proj(self.core(q, k, v, document_ids).reshape(B, S, -1))

    def _norm_rope(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head norms, then RoPE."""
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)


def decoder_block(args: Qwen3MoeArgs, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    if args.is_moe_layer(layer_idx):
        router = TopKRouter(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob
        )
        mlp = MoE(args.hidden_size, args.moe_intermediate_size, router, moe_options)
    else:
        mlp = SwiGLU(args.hidden_size, args.intermediate_size)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class Qwen3MoeForCausalLM(DecoderLM):
    def __init__(self, args: Qwen3MoeArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.head_dim, yarn=yarn_of(args))
