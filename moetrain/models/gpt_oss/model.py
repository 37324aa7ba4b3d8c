"""GPT-OSS (Hugging Face `GptOssForCausalLM` semantics), plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + attn(norm(h));  h = h + moe(norm(h))
    logits = head(norm(h))

What sets it apart, all stated here and carried out by the shared pieces:
- attention with biases on q/k/v/o, a learned sink logit per head (`sinks`), and a sliding
  window on the layers `layer_types` marks (the `AttentionCore`'s variants), YaRN RoPE;
- a router with a bias, softmax over the top-k logits;
- experts with biases and a clamped SwiGLU: gate <= limit, -limit <= up <= limit,
  out = (up + 1) * gate * sigmoid(alpha * gate).

Parameter names mirror Hugging Face's without the leading "model.", except the router
(`mlp.gate`, as every MoE here; HF: `mlp.router`) and the experts, stored as the other
models store theirs (`gate_up_proj [E, 2I, H]`, gate rows then up rows); hf.py converts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import DecoderLM
from moetrain.models.common.grouped_gemm import grouped_mm
from moetrain.models.common.moe import MoE, MoEOptions, RoutedExperts, TopKRouter
from moetrain.models.common.rope import apply_rope, yarn_of
from moetrain.models.gpt_oss.args import GptOssArgs


class Attention(nn.Module):
    def __init__(self, args: GptOssArgs, layer_idx: int) -> None:
        super().__init__()
        d, heads, kv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, heads * d, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=True)
        self.o_proj = nn.Linear(heads * d, args.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.empty(heads))
        sliding = args.layer_type(layer_idx) == "sliding_attention"
        self.core = AttentionCore(
            d**-0.5, causal=True, window=args.sliding_window if sliding else None
        )

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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, document_ids, self.sinks)
        return self.o_proj(out.reshape(B, S, -1))


class ClampedSwiGLUExperts(RoutedExperts):
    """E experts with biases and GPT-OSS's clamped SwiGLU, stacked in nn.Linear's (out, in)
    orientation: gate_up_proj [E, 2I, H] (gate rows first), gate_up_proj_bias [E, 2I],
    down_proj [E, H, I], down_proj_bias [E, H]."""

    def __init__(
        self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float, gemm: str
    ) -> None:
        super().__init__()
        self.alpha, self.limit, self.gemm = alpha, limit, gemm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))

    def ffn(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        weights = [self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias]
        # Under expert parallelism: this rank's experts, whose tokens the dispatcher delivered.
        gate_up, gate_up_bias, down, down_bias = (
            w.to_local() if isinstance(w, DTensor) else w for w in weights
        )
        # Each row's expert (output_size given: no device-to-host sync for the size).
        experts = torch.arange(len(tokens_per_expert), device=x.device)
        expert_of_row = torch.repeat_interleave(experts, tokens_per_expert, output_size=len(x))
        h = grouped_mm(x, gate_up.transpose(-2, -1), tokens_per_expert, self.gemm)
        gate, up = (h + gate_up_bias[expert_of_row]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = grouped_mm(act, down.transpose(-2, -1), tokens_per_expert, self.gemm)
        return out + down_bias[expert_of_row]


def decoder_block(args: GptOssArgs, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    router = TopKRouter(
        args.hidden_size, args.num_local_experts, args.num_experts_per_tok, True, bias=True
    )
    experts = ClampedSwiGLUExperts(
        args.num_local_experts,
        args.hidden_size,
        args.intermediate_size,
        args.swiglu_alpha,
        args.swiglu_limit,
        moe_options.gemm,
    )
    mlp = MoE(args.hidden_size, args.intermediate_size, router, moe_options, experts=experts)
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, Attention(args, layer_idx), mlp)


class GptOssForCausalLM(DecoderLM):
    # The experts' stacked biases start at zero as the projections' do; the sinks are drawn.
    zero_leaves = ("bias", "gate_up_proj_bias", "down_proj_bias")

    def __init__(self, args: GptOssArgs, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.head_dim, yarn=yarn_of(args))
