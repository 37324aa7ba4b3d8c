"""Hyper-parameters of GPT-OSS, named as in Hugging Face's `GptOssConfig`.

Defaults are gpt-oss-120b's (36 layers, 128 experts); gpt-oss-20b differs in
`num_hidden_layers = 24` and `num_local_experts = 32`. `layer_types` left empty means
Hugging Face's default: sliding-window attention on even layers, full attention on odd ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import FACTOR_NOTE, LENGTH_NOTE, YARN

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssArgs:
    vocab_size: int = _h(201088, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(2880, "model width", gt=0)
    intermediate_size: int = _h(2880, "hidden width of each routed expert", gt=0)
    num_hidden_layers: int = _h(36, "number of decoder blocks (every one is MoE)", gt=0)
    num_attention_heads: int = _h(64, "query heads", gt=0)
    num_key_value_heads: int = _h(8, "key/value heads (GQA); must divide num_attention_heads", gt=0)
    head_dim: int = _h(64, "per-head width", gt=0)
    num_local_experts: int = _h(128, "routed experts per MoE layer", gt=0)
    num_experts_per_tok: int = _h(4, "experts each token is routed to (top-k)", gt=0)
    sliding_window: int = _h(
        128, "keys a sliding-window layer's query sees (itself included)", gt=0
    )
    layer_types: list[str] = _h(
        [],
        "attention of each layer: sliding_attention | full_attention (empty: sliding on even "
        "layers, full on odd ones)",
        choices=LAYER_TYPES,
    )
    rms_norm_eps: float = _h(1e-5, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(150000.0, "RoPE base frequency", gt=0)
    rope_type: str = _h("yarn", "RoPE scaling: default or yarn", choices=("default", "yarn"))
    rope_factor: float = _h(
        32.0, "YaRN: context extension factor", ge=1, note=FACTOR_NOTE, only_with=YARN
    )
    rope_original_max_position_embeddings: int = _h(
        4096, "YaRN: pre-training context", gt=0, note=LENGTH_NOTE, only_with=YARN
    )
    rope_beta_fast: float = _h(
        32.0, "YaRN: extrapolation boundary of the ramp", gt=0, only_with=YARN
    )
    rope_beta_slow: float = _h(
        1.0, "YaRN: interpolation boundary of the ramp", gt=0, only_with=YARN
    )
    rope_truncate: bool = _h(
        False, "YaRN: round the correction range to whole dims", only_with=YARN
    )
    max_position_embeddings: int = _h(131072, "longest position the model is meant for", gt=0)
    swiglu_alpha: float = _h(1.702, "sigmoid gain of the experts' clamped SwiGLU", gt=0)
    swiglu_limit: float = _h(7.0, "clamp of the SwiGLU's gate (above) and up (both sides)", gt=0)
    router_aux_loss_coef: float = _h(
        0.001, "weight of the load-balancing auxiliary loss", ge=0, note="0 = off"
    )
    initializer_range: float = _h(0.02, "std of the normal init of the weights", gt=0)
    embedding_init_std: float = embedding_init_std()
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")

    def layer_type(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return LAYER_TYPES[i % 2]

    def validate(self) -> list[str]:
        errors = []
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            errors.append(
                f"model.num_attention_heads ({heads}) must be a multiple of "
                f"model.num_key_value_heads ({kv})"
            )
        if self.head_dim % 2:
            errors.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            errors.append(
                f"model.layer_types has {len(self.layer_types)} entries for "
                f"model.num_hidden_layers={self.num_hidden_layers}: give one per layer (or none)"
            )
        if self.num_local_experts < self.num_experts_per_tok:
            errors.append(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"model.num_local_experts ({self.num_local_experts})"
            )
        return errors
