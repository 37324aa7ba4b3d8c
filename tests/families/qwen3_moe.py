"""Qwen3-MoE's table for the model suite (tests/families/family.py)."""

from tests.families.family import ArgsProblems, Aux, Family, Flops, Refusal

# Qwen/Qwen3-30B-A3B's config.json (transformers-4 dialect), whose values our defaults are.
PUBLISHED = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

FAMILY = Family(
    name="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    hf_config_class="Qwen3MoeConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,  # not hidden/heads: the explicit head_dim must be honoured
        num_experts=8,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        max_position_embeddings=256,
        router_aux_loss_coef=0.01,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    cases={
        "topk_norm": dict(norm_topk_prob=True),
        "no_topk_norm_tied": dict(norm_topk_prob=False, tie_word_embeddings=True),
        "sparse_step_2": dict(norm_topk_prob=True, decoder_sparse_step=2),
        "mlp_only_layers": dict(norm_topk_prob=False, mlp_only_layers=[0, 2]),
        # YaRN, as a context extension sets it (Qwen3's published recipe: factor and the
        # original length), and with every option transformers reads.
        "yarn": dict(
            norm_topk_prob=True,
            max_position_embeddings=64,
            rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        ),
        "yarn_all_options": dict(
            norm_topk_prob=True,
            rope=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=8,
                beta_fast=16.0,
                beta_slow=2.0,
                mscale=1.0,
                mscale_all_dim=0.5,
                truncate=False,
            ),
        ),
    },
    moe_layers={"sparse_step_2": [1], "mlp_only_layers": [1], "topk_norm": [0, 1, 2]},
    published=PUBLISHED,
    aux=Aux.POOLED,
    packed_case="sparse_step_2",
    expert_width_field="moe_intermediate_size",
    flops=Flops("topk_norm", attention=6 * 3 * 4 * (12 + 12) * 64, aux_loss_coef=0.01),
    refusals={
        "model_type": Refusal(dict(model_type="llama"), "model_type"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear"}), "rope_scaling has RoPE type 'linear'.*remove"
        ),
    },
    bounds={
        "zero_width_negative_aux": ArgsProblems(
            dict(hidden_size=0, router_aux_loss_coef=-0.1),
            ("model.hidden_size must be > 0", "router_aux_loss_coef must be >= 0"),
        ),
    },
    cross_field={
        "heads_and_odd_head_dim": ArgsProblems(
            dict(num_key_value_heads=3, head_dim=7),
            ("multiple of model.num_key_value_heads", "even for RoPE"),
        ),
    },
    layouts_elsewhere="tests/test_layout_parity.py (every layout against a one-process reference)",
)
