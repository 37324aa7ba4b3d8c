"""DeepSeek-V3 (Hugging Face `DeepseekV3ForCausalLM` semantics) plus multi-token
prediction, plain PyTorch.

    h = embed(tokens)
    for each block:  h = h + MLA(norm(h));  h = h + ffn(norm(h))  # dense for the first k
    logits = head(norm(h))
    MTP depth k:  h = norm_k(block_k(eh_proj([enorm(embed(token i+k)); hnorm(h)])))
                  logits_k = head(h)                # predicts token i+k+1 at position i
                  (h at depth 1: the main model's normed output)

Parameter names mirror Hugging Face's without the leading "model."; the adapter in hf.py
maps the stacked experts and the MTP modules (HF: `model.layers.{L + k}`).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.block import DecoderBlock
from moetrain.models.common.decoder import ROUTING_STATE, DecoderLM
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import GroupLimitedRouter, MoE, MoEOptions, RouterStats
from moetrain.models.common.norm import RMSNorm
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.common.recompute import recomputed
from moetrain.models.common.rope import (
    apply_rope,
    apply_rope_interleaved,
    yarn_mscale,
    yarn_of,
)
from moetrain.models.common.staged import HeadOutput, causal_lm_forward
from moetrain.models.deepseek_v3.args import DeepseekV3Args

# NOTE: transformers builds q_a_layernorm and kv_a_layernorm with its default epsilon,
# whatever rms_norm_eps says; so do we, or the logits would differ.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: queries through an optional low-rank bottleneck, keys
    and values expanded from one compressed latent, plus one RoPE key head shared by all
    heads. Keys have qk_nope + qk_rope dims, values v_head_dim (they may differ)."""

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__()
        self.heads, self.nope, self.rope = (
            args.num_attention_heads,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
        )
        self.v_dim, self.kv_rank = args.v_head_dim, args.kv_lora_rank
        self.interleave = args.rope_interleave
        dim, qk_dim, bias = args.hidden_size, args.qk_head_dim, args.attention_bias
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(dim, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, self.heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, self.heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, dim, bias=bias)
        scale = qk_dim**-0.5
        yarn = yarn_of(args)
        if yarn is not None and yarn.mscale_all_dim:  # YaRN also sharpens the softmax
            scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        self.core = AttentionCore(scale=scale, causal=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        if hasattr(self, "q_proj"):
            q_in = x
        else:
            q_in = self.q_a_layernorm(self.q_a_proj(x))  # the query latent, normed
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        # NOTE: one region from the latents to the attention's inputs: under `selective`
        # recomputation (DeepSeek-V3 report §3.2.3) the kernel's saved q, k, v are rebuilt
        # in backward from the latents, the up-projections run again
        # (moetrain/models/common/recompute.py); the latents' norms are regions of their own.
        q, k, v = recomputed(self._expand, q_in, self.kv_a_layernorm(latent), k_rope, cos, sin)
        out = self.core(q, k, v, document_ids)  # [B, S, H, v_head_dim]
        return self.o_proj(out.reshape(B, S, self.heads * self.v_dim))

    def _expand(
        self,
        q_in: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections and RoPE: (the normed query latent, or x without q LoRA; the
        normed KV latent; the RoPE key) -> q, k [B, S, H, nope + rope], v [B, S, H, v]."""
        B, S, _ = latent.shape
        q = self.q_proj(q_in) if hasattr(self, "q_proj") else self.q_b_proj(q_in)
        q_nope, q_rope = q.view(B, S, self.heads, -1).split([self.nope, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(B, S, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, S, H, nope], [B, S, H, v]
        rotate = apply_rope_interleaved if self.interleave else apply_rope
        q_rope = rotate(q_rope, cos, sin)
        k_rope = rotate(k_rope.view(B, S, 1, self.rope), cos, sin)  # one head, shared
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, S, H, nope + rope]
        k = torch.cat([k_nope, k_rope.expand(B, S, self.heads, self.rope)], dim=-1)
        return q, k, v


def decoder_block(args: DeepseekV3Args, layer_idx: int, moe_options: MoEOptions) -> DecoderBlock:
    """MLA, then an MoE with shared experts (a dense SwiGLU in the first layers)."""
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
    return DecoderBlock(args.hidden_size, args.rms_norm_eps, MLAttention(args), mlp)


class MultiTokenPrediction(nn.Module):
    """One MTP depth (DeepSeek-V3 report §2.2): combine the previous depth's hidden state at
    position i with the embedding of token i+k, run one block; the output head is shared
    with the main model, the final norm is this module's own (HF: shared_head.norm)."""

    def __init__(self, args: DeepseekV3Args, layer_idx: int, moe_options: MoEOptions) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.block = decoder_block(args, layer_idx, moe_options)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        token_embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterStats | None]:
        """h [B, S, dim] (the previous depth's normed output), token_embeds [B, S, dim]
        (embedding of token i+k at position i) -> (this depth's normed output, which feeds
        the shared head and the next depth; its routing stats). document_ids [B, S]: the
        block's attention keeps to position i's document, as the main model's does.

        NOTE: the chain passes normed states (the main model's output after its final norm)
        as Megatron-LM's and vLLM's MTP do; the released weights were trained that way. The
        norm runs here, not in the caller: under FSDP this module's weights are only
        gathered during its own forward.
        """
        # NOTE: [embedding; hidden] is the order of the released checkpoints' eh_proj
        # columns (the report writes it the other way round).
        combined = torch.cat([self.enorm(token_embeds), self.hnorm(h)], dim=-1)
        h, stats = self.block(self.eh_proj(combined), cos, sin, document_ids)
        return self.norm(h), stats


class DeepseekV3ForCausalLM(DecoderLM):
    zero_leaves = ("bias", *ROUTING_STATE)

    def __init__(self, args: DeepseekV3Args, moe_options: MoEOptions | None = None) -> None:
        moe_options = moe_options or MoEOptions()
        blocks = [decoder_block(args, i, moe_options) for i in range(args.num_hidden_layers)]
        super().__init__(args, blocks, rope_dim=args.qk_rope_head_dim, yarn=yarn_of(args))
        depths = range(args.num_nextn_predict_layers)
        self.mtp = (
            nn.ModuleList(
                MultiTokenPrediction(args, args.num_hidden_layers + k, moe_options) for k in depths
            )
            if args.num_nextn_predict_layers
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, S]; position_ids [B, S] (the true positions when the sequence is
        split or reordered); document_ids [B, S]: a token attends only to its own document
        (None: to every earlier token); mtp_input_ids [B, S, D]: at position i, depth k's
        input token i+k (see moetrain.data.mtp_targets), needed for the MTP logits."""
        return causal_lm_forward(
            self, self.layers, input_ids, position_ids, document_ids, mtp_input_ids
        )

    # ---- the parts a pipeline stage runs (moetrain/models/common/staged.py) -------------------
    def head(
        self, h: torch.Tensor, extra: tuple, mtp_input_ids: torch.Tensor | None = None
    ) -> HeadOutput:
        """Final norm and head; then, given their inputs, the MTP depths in turn, each from
        the previous depth's normed output (the main model's first)."""
        h = self.norm(h)
        logits = self.logits(h)
        if self.mtp is None or mtp_input_ids is None:
            return HeadOutput(logits)
        mtp_logits, stats = [], []
        for k, module in enumerate(self.mtp):
            embeds = self.embed_tokens(mtp_input_ids[..., k])
            h, depth_stats = module(h, embeds, *extra)
            if depth_stats is not None:
                stats.append(depth_stats)
            mtp_logits.append(self.logits(h))
        return HeadOutput(logits, mtp_logits, stats)
