"""Hyper-parameters of GLM-4.5 MoE, named as in Hugging Face's `Glm4MoeConfig` (RoPE
scaling, `rope_type = "yarn"` and its `rope_*` keys, from `moetrain.models.common.rope_args`).

Defaults are the published zai-org/GLM-4.5 (355B total, 32B active) config.json's, not
transformers' `Glm4MoeConfig` defaults (which are mostly GLM-4.5-Air's); `hf.py` fills a
key a config.json leaves out with transformers' default.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import YaRNArgs


@dataclass
class Glm4MoeArgs(YaRNArgs):
    vocab_size: int = _h(151552, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(5120, "model width", gt=0)
    intermediate_size: int = _h(12288, "hidden width of the dense SwiGLU of the first layers", gt=0)
    moe_intermediate_size: int = _h(1536, "hidden width of each routed (and shared) expert", gt=0)
    num_hidden_layers: int = _h(92, "number of decoder blocks (the MTP layer not counted)", gt=0)
    num_attention_heads: int = _h(96, "query heads", gt=0)
    num_key_value_heads: int = _h(8, "key/value heads (GQA); must divide num_attention_heads", gt=0)
    head_dim: int = _h(128, "per-head width (explicit: 96 x 128 is not hidden_size)", gt=0)
    partial_rotary_factor: float = _h(
        0.5, "share of each head's dims that RoPE rotates (the first ones)", gt=0, le=1
    )
    use_qk_norm: bool = _h(True, "RMSNorm over each query and key head before RoPE")
    attention_bias: bool = _h(True, "bias in the q/k/v projections (o_proj has none)")
    n_routed_experts: int = _h(160, "routed experts per MoE layer", gt=0)
    n_shared_experts: int = _h(
        1, "shared experts every token goes through, each moe_intermediate_size wide", ge=0
    )
    num_experts_per_tok: int = _h(8, "routed experts each token is sent to (top-k)", gt=0)
    n_group: int = _h(1, "expert groups for group-limited routing", gt=0)
    topk_group: int = _h(1, "groups a token may route to", gt=0)
    norm_topk_prob: bool = _h(True, "renormalise the top-k scores to sum to 1")
    routed_scaling_factor: float = _h(2.5, "multiplier of the routed experts' weights", gt=0)
    first_k_dense_replace: int = _h(3, "the first k layers use a dense MLP instead of MoE", ge=0)
    rms_norm_eps: float = _h(1e-5, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(1_000_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(131072, "longest position the model is meant for", gt=0)
    # NOTE: the released checkpoints carry this many MTP layers after the decoder layers
    # (`model.layers.{num_hidden_layers + k}`); like transformers we build none and skip
    # their weights, so the value only says which checkpoint keys are expected to be unread.
    num_nextn_predict_layers: int = _h(
        1, "MTP layers the checkpoint carries (not built: their weights are skipped)", ge=0
    )
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    initializer_range: float = _h(
        0.02, "std of the normal init of linear and embedding weights", ge=0
    )
    embedding_init_std: float = embedding_init_std()
    # Not a Glm4MoeConfig key: transformers' GLM-4.5 computes no balance loss (the release
    # balances with the correction bias, moe.bias_update_rate). A training choice.
    router_aux_loss_coef: float = _h(
        0.0,
        "weight of the auxiliary balance loss (moe.aux_loss_mode picks which)",
        ge=0,
        note="0 = off",
    )

    @property
    def rope_dim(self) -> int:
        """The dims of each head that rotate (as transformers computes them)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def validate(self) -> list[str]:
        """Problems between fields, each naming the keys and the fix (empty when fine); the
        fields' own bounds are in their metadata, checked by `field_problems`."""
        errors = []
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_dim < 2 or self.rope_dim % 2:
            errors.append(
                f"model.head_dim * model.partial_rotary_factor (int({self.head_dim} * "
                f"{self.partial_rotary_factor}) = {self.rope_dim}) must be even and >= 2: the "
                "rotated dims are cos/sin pairs"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            errors.append(
                f"model.first_k_dense_replace must be in [0, num_hidden_layers="
                f"{self.num_hidden_layers}], got {self.first_k_dense_replace}"
            )
        return errors + self._routing_errors()

    def _routing_errors(self) -> list[str]:
        e, groups = self.n_routed_experts, self.n_group
        if e % groups or e // groups < 2:
            return [
                f"model.n_routed_experts ({e}) must split into model.n_group ({groups}) groups "
                "of at least 2 experts (a group's score is its top-2 sum); change either"
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
