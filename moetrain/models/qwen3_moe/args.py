"""Hyper-parameters of Qwen3-MoE, named as in Hugging Face's `Qwen3MoeConfig` (RoPE scaling,
`rope_type = "yarn"` and its `rope_*` keys, from `moetrain.models.common.rope_args`)."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import YaRNArgs


@dataclass
class Qwen3MoeArgs(YaRNArgs):
    vocab_size: int = _h(151936, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(2048, "model width", gt=0)
    intermediate_size: int = _h(
        6144, "hidden width of the dense SwiGLU MLP (mlp_only/non-sparse layers)", gt=0
    )
    moe_intermediate_size: int = _h(768, "hidden width of each routed expert", gt=0)
    num_hidden_layers: int = _h(48, "number of decoder blocks", gt=0)
    num_attention_heads: int = _h(32, "query heads", gt=0)
    num_key_value_heads: int = _h(4, "key/value heads (GQA); must divide num_attention_heads", gt=0)
    head_dim: int = _h(128, "per-head width (explicit, need not be hidden_size / heads)", gt=0)
    rms_norm_eps: float = _h(1e-6, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(1_000_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(40960, "longest position the model is meant for")
    num_experts: int = _h(128, "routed experts per MoE layer", ge=0)
    num_experts_per_tok: int = _h(8, "experts each token is routed to (top-k)")
    norm_topk_prob: bool = _h(True, "renormalise the top-k router probabilities to sum to 1")
    decoder_sparse_step: int = _h(1, "layer i is MoE when (i + 1) % decoder_sparse_step == 0", gt=0)
    mlp_only_layers: list[int] = _h([], "layer indices that use the dense MLP instead of MoE")
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    router_aux_loss_coef: float = _h(
        0.001, "weight of the load-balancing auxiliary loss (0 = off)", ge=0
    )
    initializer_range: float = _h(
        0.02, "std of the normal init of linear and embedding weights", ge=0
    )
    embedding_init_std: float = embedding_init_std()
    attention_bias: bool = _h(False, "bias in the q/k/v/o projections")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> list[str]:
        """Problems between fields, each naming the keys and the fix (empty when fine); the
        fields' own bounds are in their metadata, checked by `field_problems`."""
        errors = []
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            errors.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            errors.append(
                f"model.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            errors.append(
                f"model.mlp_only_layers has indices outside [0, {self.num_hidden_layers}): {bad_layers}"
            )
        return errors
