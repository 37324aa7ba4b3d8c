"""Hyper-parameters of DeepSeek-V3, named as in Hugging Face's `DeepseekV3Config`.

Defaults are DeepSeek-V3 (671B) except `num_nextn_predict_layers` (multi-token prediction
is off unless asked for) and RoPE (plain unless `rope_type = "yarn"`). TOML has no null,
so `q_lora_rank = 0` stands for Hugging Face's `q_lora_rank: null` (a plain q_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import arg as _h


@dataclass
class DeepseekV3Args:
    vocab_size: int = _h(129280, "vocabulary size (rows of the embedding and the LM head)")
    hidden_size: int = _h(7168, "model width")
    intermediate_size: int = _h(18432, "hidden width of the dense SwiGLU of the first layers")
    moe_intermediate_size: int = _h(2048, "hidden width of each routed (and shared) expert")
    num_hidden_layers: int = _h(61, "number of decoder blocks")
    num_attention_heads: int = _h(128, "attention heads (MLA: keys and values have as many)")
    q_lora_rank: int = _h(1536, "rank of the query compression; 0 = plain q_proj (no LoRA)")
    kv_lora_rank: int = _h(512, "rank of the joint key/value compression")
    qk_nope_head_dim: int = _h(128, "per-head query/key width without RoPE")
    qk_rope_head_dim: int = _h(64, "per-head query/key width with RoPE (one shared key head)")
    v_head_dim: int = _h(128, "per-head value width")
    n_routed_experts: int = _h(256, "routed experts per MoE layer")
    n_shared_experts: int = _h(1, "shared experts every token goes through (0 = none)")
    num_experts_per_tok: int = _h(8, "routed experts each token is sent to (top-k)")
    n_group: int = _h(8, "expert groups for group-limited routing")
    topk_group: int = _h(4, "groups a token may route to")
    norm_topk_prob: bool = _h(True, "renormalise the top-k scores to sum to 1")
    routed_scaling_factor: float = _h(2.5, "multiplier of the routed experts' weights")
    first_k_dense_replace: int = _h(3, "the first k layers use a dense MLP instead of MoE")
    rms_norm_eps: float = _h(1e-6, "epsilon of the block and final RMSNorms")
    rope_theta: float = _h(10000.0, "RoPE base frequency")
    rope_interleave: bool = _h(True, "RoPE on interleaved pairs (DeepSeek's weight layout)")
    rope_type: str = _h("default", "RoPE scaling: default or yarn")
    rope_factor: float = _h(1.0, "YaRN: context extension factor")
    rope_original_max_position_embeddings: int = _h(4096, "YaRN: pre-training context length")
    rope_beta_fast: float = _h(32.0, "YaRN: extrapolation boundary of the ramp")
    rope_beta_slow: float = _h(1.0, "YaRN: interpolation boundary of the ramp")
    rope_mscale: float = _h(
        0.0, "YaRN: mscale (0 = unset; with mscale_all_dim it sets the cos/sin scale)"
    )
    rope_mscale_all_dim: float = _h(
        0.0, "YaRN: mscale_all_dim (0 = unset; also scales the softmax)"
    )
    rope_truncate: bool = _h(True, "YaRN: round the correction range to whole dims")
    max_position_embeddings: int = _h(163840, "longest position the model is meant for")
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    initializer_range: float = _h(0.02, "std of the normal init of linear and embedding weights")
    attention_bias: bool = _h(False, "bias in q_a/kv_a/o projections")
    num_nextn_predict_layers: int = _h(0, "multi-token prediction modules (0 = off)")
    mtp_loss_weight: float = _h(0.1, "lambda: weight of the mean MTP loss")
    router_aux_loss_coef: float = _h(
        0.0, "weight of the auxiliary balance loss (0 = off; moe.aux_loss_mode picks which)"
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.n_routed_experts > 0

    def validate(self) -> list[str]:
        """Problems with these values, each naming the key and the fix (empty when fine)."""
        errors = []
        positive = (
            "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
            "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
            "n_group topk_group num_experts_per_tok"
        )
        for name in positive.split():
            if getattr(self, name) <= 0:
                errors.append(f"model.{name} must be > 0, got {getattr(self, name)}")
        for name in ("q_lora_rank", "n_shared_experts", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                errors.append(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            errors.append(f"model.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            errors.append(
                f"model.first_k_dense_replace must be in [0, num_hidden_layers="
                f"{self.num_hidden_layers}], got {self.first_k_dense_replace}"
            )
        if self.rope_type not in ("default", "yarn"):
            errors.append(f"model.rope_type must be default or yarn, got {self.rope_type!r}")
        errors += self._routing_errors()
        return errors

    def _routing_errors(self) -> list[str]:
        e, groups = self.n_routed_experts, self.n_group
        if e <= 0 or groups <= 0:
            return [] if e >= 0 else [f"model.n_routed_experts must be >= 0, got {e}"]
        if e % groups or e // groups < 2:
            return [
                f"model.n_routed_experts ({e}) must split into model.n_group ({groups}) groups "
                "of at least 2 experts (a group's score is its top-2 sum)"
            ]
        errors = []
        if self.topk_group > groups:
            errors.append(f"model.topk_group ({self.topk_group}) must be <= n_group ({groups})")
        reachable = min(self.topk_group, groups) * (e // groups)
        if self.num_experts_per_tok > reachable:
            errors.append(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"topk_group groups ({reachable}); lower it or raise model.topk_group"
            )
        return errors
