"""Hyper-parameters of Mixtral, named as in Hugging Face's `MixtralConfig`.

Defaults are those of the published mistralai/Mixtral-8x7B-v0.1 (8 experts of width 14336,
top-2 with the two weights renormalised, GQA with 8 key/value heads, no sliding window).
TOML has no null, so `sliding_window` is left out of a config file to mean "unset".
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std


@dataclass
class MixtralArgs:
    vocab_size: int = _h(32000, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(4096, "model width", gt=0)
    intermediate_size: int = _h(14336, "hidden width of each routed expert", gt=0)
    num_hidden_layers: int = _h(32, "number of decoder blocks (every one is MoE)", gt=0)
    num_attention_heads: int = _h(32, "query heads", gt=0)
    num_key_value_heads: int = _h(8, "key/value heads (GQA); must divide num_attention_heads", gt=0)
    head_dim: int = _h(128, "per-head width (need not be hidden_size / heads)", gt=0)
    rms_norm_eps: float = _h(1e-5, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(1_000_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(32768, "longest position the model is meant for", gt=0)
    sliding_window: int | None = _h(
        None,
        "keys each query sees (itself included), on every layer; unset = full causal attention",
        gt=0,
    )
    num_local_experts: int = _h(8, "routed experts per MoE layer", gt=0)
    num_experts_per_tok: int = _h(2, "experts each token is routed to (top-k)", gt=0)
    tie_word_embeddings: bool = _h(False, "share the embedding matrix with the LM head")
    router_aux_loss_coef: float = _h(
        0.02, "weight of the load-balancing auxiliary loss", ge=0, note="0 = off"
    )
    initializer_range: float = _h(
        0.02, "std of the normal init of linear, embedding, router and expert weights", gt=0
    )
    embedding_init_std: float = embedding_init_std()

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
        if self.head_dim % 2:
            errors.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if 0 < self.num_local_experts < self.num_experts_per_tok:
            errors.append(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"model.num_local_experts ({self.num_local_experts})"
            )
        return errors
