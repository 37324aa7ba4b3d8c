"""Hyper-parameters of Qwen2-MoE, named as in Hugging Face's `Qwen2MoeConfig` (RoPE scaling,
`rope_type = "yarn"` and its `rope_*` keys, from `moetrain.models.common.rope_args`).

Defaults are the published Qwen/Qwen1.5-MoE-A2.7B config.json's: 60 routed experts of
width 1408, top-4 without renormalisation, one shared expert of width 5632 behind a
sigmoid gate, q/k/v biases, 16 query and 16 key/value heads of 128.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import YaRNArgs


@dataclass
class Qwen2MoeArgs(YaRNArgs):
    vocab_size: int = _h(151936, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(2048, "model width", gt=0)
    intermediate_size: int = _h(
        5632, "hidden width of the dense SwiGLU MLP (layers that are not MoE)", gt=0
    )
    moe_intermediate_size: int = _h(1408, "hidden width of each routed expert", gt=0)
    shared_expert_intermediate_size: int = _h(
        5632, "hidden width of the shared expert every token of an MoE layer goes through", gt=0
    )
    num_hidden_layers: int = _h(24, "number of decoder blocks", gt=0)
    num_attention_heads: int = _h(16, "query heads (head width = hidden_size / heads)", gt=0)
    num_key_value_heads: int = _h(
        16, "key/value heads (GQA); must divide num_attention_heads", gt=0
    )
    rms_norm_eps: float = _h(1e-6, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(1_000_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(8192, "longest position the model is meant for", gt=0)
    num_experts: int = _h(60, "routed experts per MoE layer (0 = every layer dense)", ge=0)
    num_experts_per_tok: int = _h(4, "experts each token is routed to (top-k)", gt=0)
    norm_topk_prob: bool = _h(False, "renormalise the top-k router probabilities to sum to 1")
    decoder_sparse_step: int = _h(1, "layer i is MoE when (i + 1) % decoder_sparse_step == 0", gt=0)
    mlp_only_layers: list[int] = _h([], "layer indices that use the dense MLP instead of MoE")
    qkv_bias: bool = _h(True, "bias in the q/k/v projections (o_proj never has one)")
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    router_aux_loss_coef: float = _h(
        0.001, "weight of the load-balancing auxiliary loss", ge=0, note="0 = off"
    )
    initializer_range: float = _h(
        0.02, "std of the normal init of linear, embedding, router and expert weights", ge=0
    )
    embedding_init_std: float = embedding_init_std()

    @property
    def head_dim(self) -> int:
        """Per-head width: Qwen2-MoE has no head_dim key, heads split the model width."""
        return self.hidden_size // max(self.num_attention_heads, 1)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """As transformers decides it: mlp_only_layers first, then the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> list[str]:
        """Problems between fields, each naming the keys and the fix (empty when fine); the
        fields' own bounds are in their metadata, checked by `field_problems`."""
        errors = []
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            errors.append(
                f"model.num_attention_heads ({heads}) must be a multiple of "
                f"model.num_key_value_heads ({kv})"
            )
        if self.hidden_size % heads:
            errors.append(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of "
                f"model.num_attention_heads ({heads}): the heads split the model width"
            )
        elif self.head_dim % 2:
            errors.append(
                f"the head width hidden_size / num_attention_heads ({self.head_dim}) must be "
                "even for RoPE; change model.hidden_size or model.num_attention_heads"
            )
        if 0 < self.num_experts < self.num_experts_per_tok:
            errors.append(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"model.num_experts ({self.num_experts})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            errors.append(
                f"model.mlp_only_layers has indices outside [0, {self.num_hidden_layers}): {bad}"
            )
        return errors
