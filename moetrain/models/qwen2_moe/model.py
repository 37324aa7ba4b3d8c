"""Qwen2-MoE (Hugging Face `Qwen2MoeForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + ffn(norm(h))
    logits = head(norm(h))

    ffn (MoE layer):  routed(x) + sigmoid(shared_expert_gate(x)) * shared_experts(x)
    ffn (dense layer, `is_moe_layer` false): SwiGLU(x)

What sets it apart from Qwen3-MoE, its successor: biases on q/k/v (not o), no q/k norms,
a head width fixed at hidden_size / heads, and a shared expert behind a per-token sigmoid
gate. Parameter names mirror Hugging Face's without the leading "model.", except the
stacked routed experts and `mlp.shared_experts` (HF: `mlp.shared_expert`), both mapped in
hf.py by data alone.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import DecoderLM
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter
from moetrain.models.common.rope import apply_rope, yarn_of
from moetrain.models.qwen2_moe.args import Qwen2MoeArgs


class Attention(nn.Module):
    def __init__(self, args: Qwen2MoeArgs) -> None:
        super().__init__()
        d, bias = args.head_dim, args.qkv_bias
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        # The output projection has no bias whatever qkv_bias says, as in transformers.
        self.o_proj = nn.Linear(args.num_attention_heads * d, args.hidden_size, bias=False)
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.core(q, k, v, document_ids).reshape(B, S, -1))


def decoder_block(args: Qwen2MoeArgs, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    if args.is_moe_layer(layer_idx):
        router = TopKRouter(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob
        )
        mlp = MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            router,
            moe_options,
            shared_hidden_dim=args.shared_expert_intermediate_size,
            shared_gate=True,
        )
    else:
        mlp = SwiGLU(args.hidden_size, args.intermediate_size)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class Qwen2MoeForCausalLM(DecoderLM):
    def __init__(self, args: Qwen2MoeArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.head_dim, yarn=yarn_of(args))
