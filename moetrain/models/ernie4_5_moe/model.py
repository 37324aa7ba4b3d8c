"""ERNIE-4.5 MoE (Hugging Face `Ernie4_5_MoeForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + ffn(norm(h))   # ffn: MoE or dense SwiGLU
    logits = head(norm(h))

Attention is GQA with RoPE on interleaved pairs (GPT-J style). Layer i is MoE when
(i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index;
its router is a softmax whose experts are chosen with a correction bias the weights never
see (`BiasedSoftmaxRouter`), and `moe_num_shared_experts` shared experts (one SwiGLU of
n times the width) run beside the routed ones. `use_bias` puts biases on q/k/v/o, on the
dense and shared MLPs and on the LM head (which keeps its own bias when tied).

Parameter names mirror Hugging Face's without the leading "model."; hf.py maps the stacked
experts and the routing bias, which the checkpoint keeps under `mlp.moe_statics`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.bias_router import BiasedSoftmaxRouter
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import ROUTING_STATE, DecoderLM
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import MoE, MoEOptions
from moetrain.models.common.rope import apply_rope_interleaved, yarn_of
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs


class Attention(nn.Module):
    def __init__(self, args: Ernie45MoeArgs) -> None:
        super().__init__()
        d, bias = args.head_dim, args.use_bias
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(args.num_attention_heads * d, args.hidden_size, bias=bias)
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
        v = self.v_proj(x).view(B, S, -1, self.head_dim)
        # NOTE: q and k come back with the same permutation of their dims (de-interleaved),
        # which leaves every q.k, and so the attention, as transformers computes it.
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        return self.o_proj(self.core(q, k, v, document_ids).reshape(B, S, -1))


def decoder_block(args: Ernie45MoeArgs, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    if args.is_moe_layer(layer_idx):
        router = BiasedSoftmaxRouter(
            args.hidden_size, args.moe_num_experts, args.moe_k, args.moe_norm_min
        )
        shared = args.moe_intermediate_size * args.moe_num_shared_experts
        mlp = MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            router,
            moe_options,
            shared,
            shared_bias=args.use_bias,
        )
    else:
        mlp = SwiGLU(args.hidden_size, args.intermediate_size, args.use_bias)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args), mlp)


class TiedHeadBias(nn.Module):
    """The LM head's bias when its weight is the embedding's (tied, with `use_bias`): HF's
    `lm_head.bias`, a parameter of its own."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(vocab_size))


class Ernie45MoeForCausalLM(DecoderLM):
    zero_leaves = ("bias", *ROUTING_STATE)

    def __init__(self, args: Ernie45MoeArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.head_dim, yarn=yarn_of(args))

    def output_head(self, args: Ernie45MoeArgs) -> nn.Module | None:
        """With `use_bias`, the head has a bias, also when its weight is the embedding's."""
        if not args.tie_word_embeddings:
            return nn.Linear(args.hidden_size, args.vocab_size, bias=args.use_bias)
        return TiedHeadBias(args.vocab_size) if args.use_bias else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [B, S, hidden] -> logits [B, S, vocab], with the head's bias."""
        tied = self.args.tie_word_embeddings
        weight = self.embed_tokens.weight if tied else self.lm_head.weight
        return F.linear(h, weight, None if self.lm_head is None else self.lm_head.bias)
