"""GLM-4.5 MoE (Hugging Face `Glm4MoeForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + ffn(norm(h))  # dense for the first k
    logits = head(norm(h))

Attention is GQA with q/k/v biases (`attention_bias`), optional per-head q/k RMSNorm
(`use_qk_norm`) and RoPE on the first `head_dim * partial_rotary_factor` dims of each head.
The MoE layers route like DeepSeek-V3 (sigmoid affinities, correction bias, expert groups,
`routed_scaling_factor`) and add shared experts. The checkpoints' MTP layer is not built,
as transformers builds none (hf.py skips its weights).

Parameter names mirror Hugging Face's without the leading "model." so the adapter in
hf.py stays a thin renaming, except for the stacked expert weights.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import ROUTING_STATE, DecoderLM
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import GroupLimitedRouter, MoE, MoEOptions
from moetrain.models.common.norm import RMSNorm
from moetrain.models.common.rope import apply_rope, yarn_of
from moetrain.models.glm4_moe.args import Glm4MoeArgs


class Attention(nn.Module):
    def __init__(self, args: Glm4MoeArgs) -> None:
        super().__init__()
        d, bias = args.head_dim, args.attention_bias
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        # NOTE: no bias on o_proj whatever attention_bias says, as in transformers' Glm4Moe
        # and the released weights.
        self.o_proj = nn.Linear(args.num_attention_heads * d, args.hidden_size, bias=False)
        if args.use_qk_norm:  # per head, over all head_dim dims, before RoPE
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core = AttentionCore(scale=d**-0.5, causal=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim]; cos/sin [B, S, rope_dim] (rope_dim <= head_dim: partial rotary)."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hq, D]
        k = self.k_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        v = self.v_proj(x).view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.core(q, k, v, document_ids).reshape(B, S, -1))


def decoder_block(args: Glm4MoeArgs, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    """Attention, then an MoE with shared experts (a dense SwiGLU in the first layers)."""
    if args.is_moe_layer(layer_idx):
        router = GroupLimitedRouter(
            args.hidden_size,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )
        shared = args.moe_intermediate_size * args.n_shared_experts
        mlp = MoE(args.hidden_size, args.moe_intermediate_size, router, moe_options, shared)
    else:
        mlp = SwiGLU(args.hidden_size, args.intermediate_size)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class Glm4MoeForCausalLM(DecoderLM):
    zero_leaves = ("bias", *ROUTING_STATE)

    def __init__(self, args: Glm4MoeArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        # cos/sin as wide as the rotated dims, their frequencies spread over those dims
        # alone (as transformers computes them); apply_rope passes the rest of each head.
        super().__init__(args, blocks, rope_dim=args.rope_dim, yarn=yarn_of(args))
