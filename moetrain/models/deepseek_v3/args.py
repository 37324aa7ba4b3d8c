"""Hyper-parameters of DeepSeek-V3, named as in Hugging Face's `DeepseekV3Config`.

Defaults are DeepSeek-V3 (671B) except `num_nextn_predict_layers` (multi-token prediction
is off unless asked for) and RoPE (plain unless `rope_type = "yarn"`). TOML has no null,
so `q_lora_rank = 0` stands for Hugging Face's `q_lora_rank: null` (a plain q_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import YaRNArgs


@dataclass
class DeepseekV3Args(YaRNArgs):
    vocab_size: int = _h(129280, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(7168, "model width", gt=0)
    intermediate_size: int = _h(18432, "hidden width of the dense SwiGLU of the first layers", gt=0)
    moe_intermediate_size: int = _h(2048, "hidden width of each routed (and shared) expert", gt=0)
    num_hidden_layers: int = _h(61, "number of decoder blocks", gt=0)
    num_attention_heads: int = _h(128, "attention heads (MLA: keys and values have as many)", gt=0)
    q_lora_rank: int = _h(1536, "rank of the query compression; 0 = plain q_proj (no LoRA)", ge=0)
    kv_lora_rank: int = _h(512, "rank of the joint key/value compression", gt=0)
    qk_nope_head_dim: int = _h(128, "per-head query/key width without RoPE", gt=0)
    qk_rope_head_dim: int = _h(64, "per-head query/key width with RoPE (one shared key head)", gt=0)
    v_head_dim: int = _h(128, "per-head value width", gt=0)
    n_routed_experts: int = _h(256, "routed experts per MoE layer", ge=0)
    n_shared_experts: int = _h(1, "shared experts every token goes through (0 = none)", ge=0)
    num_experts_per_tok: int = _h(8, "routed experts each token is sent to (top-k)", gt=0)
    n_group: int = _h(8, "expert groups for group-limited routing", gt=0)
    topk_group: int = _h(4, "groups a token may route to", gt=0)
    norm_topk_prob: bool = _h(True, "renormalise the top-k scores to sum to 1")
    routed_scaling_factor: float = _h(2.5, "multiplier of the routed experts' weights")
    first_k_dense_replace: int = _h(3, "the first k layers use a dense MLP instead of MoE")
    rms_norm_eps: float = _h(1e-6, "epsilon of the block and final RMSNorms", gt=0)
    rope_theta: float = _h(10000.0, "RoPE base frequency", gt=0)
    rope_interleave: bool = _h(True, "RoPE on interleaved pairs (DeepSeek's weight layout)")
    max_position_embeddings: int = _h(163840, "longest position the model is meant for")
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    initializer_range: float = _h(
        0.02, "std of the normal init of linear and embedding weights", ge=0
    )
    embedding_init_std: float = embedding_init_std()
    attention_bias: bool = _h(False, "bias in q_a/kv_a/o projections")
    num_nextn_predict_layers: int = _h(0, "multi-token prediction modules (0 = off)", ge=0)
    mtp_loss_weight: float = _h(0.1, "lambda: weight of the mean MTP loss", ge=0)
    router_aux_loss_coef: float = _h(
        0.0, "weight of the auxiliary balance loss (0 = off; moe.aux_loss_mode picks which)", ge=0
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.n_routed_experts > 0

    def validate(self) -> list[str]:
        """Problems between fields, each naming the keys and the fix (empty when fine); the
        fields' own bounds are in their metadata, checked by `field_problems`."""
        errors = []
        if self.qk_rope_head_dim % 2:
            errors.append(f"model.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            errors.append(
                f"model.first_k_dense_replace must be in [0, num_hidden_layers="
                f"{self.num_hidden_layers}], got {self.first_k_dense_replace}"
            )
        errors += self._routing_errors()
        return errors

    def _routing_errors(self) -> list[str]:
        e, groups = self.n_routed_experts, self.n_group
        if e <= 0 or groups <= 0:  # no experts (dense), or a bound error reported already
            return []
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
