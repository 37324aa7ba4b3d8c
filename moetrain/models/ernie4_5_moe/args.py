"""Hyper-parameters of ERNIE-4.5 MoE, named as in Hugging Face's `Ernie4_5_MoeConfig`.

Defaults are the published baidu/ERNIE-4.5-21B-A3B-PT config.json's, except
`moe_layer_end_index`: -1 (the last layer), transformers' default, which the published 27
means for its 28 layers (a config.json may leave the key out). RoPE is plain or YaRN
(`moetrain.models.common.rope_args`), applied to interleaved pairs as ERNIE's checkpoints expect.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h
from moetrain.models.common.args import embedding_init_std
from moetrain.models.common.rope_args import YaRNArgs


@dataclass
class Ernie45MoeArgs(YaRNArgs):
    vocab_size: int = _h(103424, "vocabulary size (rows of the embedding and the LM head)", gt=0)
    hidden_size: int = _h(2560, "model width", gt=0)
    intermediate_size: int = _h(12288, "hidden width of the dense SwiGLU (non-MoE layers)", gt=0)
    moe_intermediate_size: int = _h(1536, "hidden width of each routed (and shared) expert", gt=0)
    num_hidden_layers: int = _h(28, "number of decoder blocks", gt=0)
    num_attention_heads: int = _h(20, "query heads", gt=0)
    num_key_value_heads: int = _h(4, "key/value heads (GQA); must divide num_attention_heads", gt=0)
    head_dim: int = _h(128, "per-head width (config.json may omit it: hidden_size / heads)", gt=0)
    rms_norm_eps: float = _h(1e-5, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = _h(500_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = _h(131072, "longest position the model is meant for", gt=0)
    use_bias: bool = _h(False, "biases in q/k/v/o, the dense and shared MLPs, and the LM head")
    moe_num_experts: int = _h(64, "routed experts per MoE layer", ge=0)
    moe_k: int = _h(6, "experts each token is routed to (top-k)", gt=0)
    moe_num_shared_experts: int = _h(2, "shared experts every token goes through (0 = none)", ge=0)
    moe_layer_start_index: int = _h(1, "the first layer that may be MoE", ge=0)
    moe_layer_end_index: int = _h(
        -1, "the last layer that may be MoE (-1 = the last layer)", ge=-1, note="-1 = the last"
    )
    moe_layer_interval: int = _h(1, "layer i may be MoE when (i + 1) % interval == 0", gt=0)
    moe_norm_min: float = _h(1e-12, "floor of the top-k weights' sum when renormalising", gt=0)
    tie_word_embeddings: bool = _h(True, "share the embedding matrix with the LM head")
    router_aux_loss_coef: float = _h(
        0.001, "weight of the load-balancing auxiliary loss (0 = off)", ge=0
    )
    initializer_range: float = _h(
        0.02, "std of the normal init of linear and embedding weights", ge=0
    )
    embedding_init_std: float = embedding_init_std()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: every `moe_layer_interval`-th layer counted from 1, within
        [moe_layer_start_index, moe_layer_end_index]."""
        end = (
            self.num_hidden_layers - 1
            if self.moe_layer_end_index == -1
            else self.moe_layer_end_index
        )
        return (
            self.moe_num_experts > 0
            and (layer_idx + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= layer_idx <= end
        )

    def validate(self) -> list[str]:
        """Problems between fields, each naming the keys and the fix (empty when fine); the
        fields' own bounds are in their metadata, checked by `field_problems`."""
        errors = []
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            errors.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.moe_num_experts > 0 and self.moe_k > self.moe_num_experts:
            errors.append(
                f"model.moe_k ({self.moe_k}) must be <= model.moe_num_experts "
                f"({self.moe_num_experts})"
            )
        return errors
