"""Qwen2-MoE's table for the model suite (tests/families/family.py)."""

import torch
from torch import nn

from tests.families.family import (
    TRAIN_ARGV,
    TWO_RANK_LAYOUTS,
    ArgsProblems,
    Aux,
    Family,
    Flops,
    Refusal,
)

# Qwen/Qwen1.5-MoE-A2.7B's config.json (transformers-4 dialect), whose values our defaults are.
PUBLISHED = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def _wide_shared_gates(model: nn.Module, generator: torch.Generator) -> None:
    """Larger weights for the shared experts' gates, so that sigmoid(gate) ranges wide."""
    for name, p in model.named_parameters():
        if "shared_expert_gate" in name:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


FAMILY = Family(
    name="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    hf_config_class="Qwen2MoeConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=8,
        rope_theta=10000.0,
        max_position_embeddings=64,
        router_aux_loss_coef=0.01,
        initializer_range=0.2,  # larger than default so routing, attention and gates are not flat
    ),
    cases={
        # layers 1 and 3 MoE (0 and 2 dense), 2 query heads per K/V head, raw top-3 weights
        "sparse_step2_gqa_bias": dict(
            decoder_sparse_step=2,
            num_key_value_heads=2,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
        # layer 0 dense by mlp_only_layers, renormalised top-2, tied head, no q/k/v bias, YaRN
        "mlp_only_tied_topk_norm_yarn": dict(
            mlp_only_layers=[0],
            num_key_value_heads=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            qkv_bias=False,
            rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        ),
    },
    moe_layers={"sparse_step2_gqa_bias": [1, 3], "mlp_only_tied_topk_norm_yarn": [1, 2, 3]},
    perturb_extra=_wide_shared_gates,
    published=PUBLISHED,
    # (8192 positions are the published file's; transformers' is 32768, its theta 10000)
    absent_keys=(
        {"model_type": "qwen2_moe"},
        dict(mlp_only_layers=[], max_position_embeddings=32768),
    ),
    aux=Aux.POOLED,
    packed_case="sparse_step2_gqa_bias",
    expert_width_field="moe_intermediate_size",
    # routed experts count top_k / num_experts of their size; shared experts and their
    # gates, every token's, count whole
    flops=Flops("sparse_step2_gqa_bias", attention=6 * 4 * 4 * (8 + 8) * 64, aux_loss_coef=0.01),
    refusals={
        "model_type": Refusal(
            dict(model_type="qwen3_moe"), "model_type 'qwen3_moe', expected 'qwen2_moe'"
        ),
        "hidden_act": Refusal(dict(hidden_act="gelu"), "hidden_act 'gelu'.*only 'silu'"),
        "sliding_window": Refusal(
            dict(use_sliding_window=True), "use_sliding_window.*set use_sliding_window to false"
        ),
        "layer_types": Refusal(
            dict(layer_types=["sliding_attention"] * 24), "layer_types.*drop layer_types"
        ),
        "dropout": Refusal(dict(attention_dropout=0.1), "attention_dropout=0.1.*set it to 0.0"),
        "head_dim": Refusal(dict(head_dim=64), "head_dim=64, not .* = 128.*remove head_dim"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_scaling has RoPE type 'linear'.*remove",
        ),
        "dynamic_rope": Refusal(
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
            "rope_parameters .*remove",
        ),
    },
    bounds={"zero_width": ArgsProblems(dict(hidden_size=0), ("model.hidden_size must be > 0",))},
    cross_field={
        "heads_width_top_k": ArgsProblems(
            dict(num_key_value_heads=3, hidden_size=2050, num_experts_per_tok=61),
            (
                "multiple of model.num_key_value_heads",
                "hidden_size (2050) must be a multiple",
                "num_experts_per_tok (61)",
            ),
        ),
        "mlp_only_layers": ArgsProblems(dict(mlp_only_layers=[24]), ("outside [0, 24)",)),
    },
    train_argv=TRAIN_ARGV,
    layouts=TWO_RANK_LAYOUTS,
)
