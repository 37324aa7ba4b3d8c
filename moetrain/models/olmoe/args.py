"""Hyper-parameters of OLMoE, named as in Hugging Face's `OlmoeConfig`.

Defaults are those of the published allenai/OLMoE-1B-7B-0924 (64 experts of width 1024,
top-8, no renormalisation of the top-k weights, no qkv clipping). TOML has no null, so
`head_dim` and `clip_qkv` are left out of a config file to mean "unset".
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std


@dataclass
class OlmoeArgs:
    vocab_size: int = _h(50304, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(2048, "model width", gt=0)
    intermediate_size: int = _h(1024, "hidden width of each routed expert", gt=0)
    num_hidden_layers: int = _h(16, "number of decoder blocks (every one is MoE)", gt=0)
    num_attention_heads: int = _h(16, "query heads", gt=0)
    num_key_value_heads: int = _h(
        16, "key/value heads (GQA); must divide num_attention_heads", gt=0
    )
    head_dim: int | None = _h(
        None,
        "per-head width; unset = hidden_size // num_attention_heads (the only value "
        "transformers' OLMoE can load, as it sizes q_norm by hidden_size)",
        gt=0,
    )
    rms_norm_eps: float = _h(1e-5, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(10000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(4096, "longest position the model is meant for", gt=0)
    num_experts: int = _h(64, "routed experts per MoE layer", gt=0)
    num_experts_per_tok: int = _h(8, "experts each token is routed to (top-k)", gt=0)
    norm_topk_prob: bool = _h(False, "renormalise the top-k router probabilities to sum to 1")
    clip_qkv: float | None = _h(
        None, "clamp q, k (after their norms) and v to [-clip_qkv, clip_qkv]; unset = off", gt=0
    )
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    attention_bias: bool = _h(False, "bias in the q/k/v/o projections")
    router_aux_loss_coef: float = _h(
        0.01, "weight of the load-balancing auxiliary loss", ge=0, note="0 = off"
    )
    initializer_range: float = _h(
        0.02, "std of the normal init of linear, embedding and expert weights", gt=0
    )
    embedding_init_std: float = embedding_init_std()

    @property
    def resolved_head_dim(self) -> int:
        """The per-head width the model uses (`head_dim` or the width / heads split)."""
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // max(self.num_attention_heads, 1)

    def validate(self) -> list[str]:
        """Cross-field problems, each naming the keys and the fix (the single-field bounds
        are on the fields). Out-of-range values are skipped here: their bound reports them."""
        errors = []
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads > 0 and kv > 0 and heads % kv:
            errors.append(
                f"model.num_attention_heads ({heads}) must be a multiple of "
                f"model.num_key_value_heads ({kv})"
            )
        if self.head_dim is None and heads > 0 and self.hidden_size % heads:
            errors.append(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of "
                f"model.num_attention_heads ({heads}) when model.head_dim is unset; change "
                "one of them or set model.head_dim"
            )
        if self.resolved_head_dim % 2:
            errors.append(
                f"the per-head width ({self.resolved_head_dim}) must be even for RoPE; change "
                "model.head_dim or model.hidden_size / model.num_attention_heads"
            )
        if 0 < self.num_experts < self.num_experts_per_tok:
            errors.append(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"model.num_experts ({self.num_experts})"
            )
        return errors
