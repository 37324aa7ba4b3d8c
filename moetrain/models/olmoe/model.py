"""OLMoE (Hugging Face `OlmoeForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + moe(norm(h))   # every block is MoE
    logits = head(norm(h))

What sets it apart from Qwen3-MoE: q_norm / k_norm normalise the whole projected q / k of
a token (all heads at once, before the split into heads and RoPE), an optional clamp of
q, k and v (`clip_qkv`), and no dense layers. Parameter names mirror Hugging Face's
without the leading "model." so the adapter in hf.py stays a thin renaming, except for the
stacked expert weights.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import DecoderLM
from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter
from moetrain.models.common.norm import RMSNorm
from moetrain.models.common.rope import apply_rope
from moetrain.models.olmoe.args import OlmoeArgs


class Attention(nn.Module):
    def __init__(self, args: OlmoeArgs) -> None:
        super().__init__()
        d, bias = args.resolved_head_dim, args.attention_bias
        q_width, kv_width = args.num_attention_heads * d, args.num_key_value_heads * d
        self.head_dim = d
        self.clip_qkv = args.clip_qkv
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=bias)
        # One RMS over all heads of a token (not per head): the norms see the full width.
        self.q_norm = RMSNorm(q_width, args.rms_norm_eps)
        self.k_norm = RMSNorm(kv_width, args.rms_norm_eps)
        self.core = AttentionCore(scale=d**-0.5, causal=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x))  # [B, S, Hq * D]
        k = self.k_norm(self.k_proj(x))  # [B, S, Hkv * D]
        v = self.v_proj(x)  # [B, S, Hkv * D]
        if self.clip_qkv is not None:
            # The clamp acts on the normed q and k, where transformers applies it.
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(B, S, -1, self.head_dim)  # [B, S, Hq, D]
        k = k.view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        v = v.view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, document_ids)  # [B, S, Hq, D]
        return self.o_proj(out.reshape(B, S, -1))  # [B, S, Hq * D] -> hidden

    def extra_repr(self) -> str:
        return f"clip_qkv={self.clip_qkv}"


def decoder_block(args: OlmoeArgs, moe_options: MoEOptions) -> DecoderBlock:
    router = TopKRouter(
        args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob
    )
    mlp = MoE(args.hidden_size, args.intermediate_size, router, moe_options)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class OlmoeForCausalLM(DecoderLM):
    def __init__(self, args: OlmoeArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, moe_options) for _ in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.resolved_head_dim)
