"""Mixtral (Hugging Face `MixtralForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + moe(norm(h))   # every block is MoE
    logits = head(norm(h))

Attention: GQA with RoPE, no biases, and an optional sliding window on every layer (a query
sees keys fewer than `sliding_window` positions before it, as transformers' mask does). MoE:
softmax router, top-k, the k weights renormalised to sum to 1, SwiGLU experts.

Parameter names are transformers-5's in-memory ones without the leading "model." (the MoE at
`layers.{i}.mlp`, stacked experts); the published checkpoints' `block_sparse_moe` and per-
expert `w1`/`w3`/`w2` are a renaming stated as data in hf.py.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import DecoderLM
from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter
from moetrain.models.common.rope import apply_rope
from moetrain.models.mixtral.args import MixtralArgs


class Attention(nn.Module):
    def __init__(self, args: MixtralArgs) -> None:
        super().__init__()
        d = args.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(args.num_attention_heads * d, args.hidden_size, bias=False)
        # The window is stated on the core, so context parallelism carries it onto the ring.
        self.core = AttentionCore(scale=d**-0.5, causal=True, window=args.sliding_window)

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


def decoder_block(args: MixtralArgs, moe_options: MoEOptions) -> DecoderBlock:
    # Mixtral always renormalises its top-k weights (transformers has no switch for it).
    router = TopKRouter(
        args.hidden_size, args.num_local_experts, args.num_experts_per_tok, norm_topk_prob=True
    )
    mlp = MoE(args.hidden_size, args.intermediate_size, router, moe_options)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class MixtralForCausalLM(DecoderLM):
    def __init__(self, args: MixtralArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, moe_options) for _ in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.head_dim)
