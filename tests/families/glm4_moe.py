"""GLM-4.5 MoE's table for the model suite (tests/families/family.py)."""

from tests.families.family import (
    TRAIN_ARGV,
    TWO_RANK_LAYOUTS,
    ArgsProblems,
    Aux,
    Family,
    Flops,
    Refusal,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
# zai-org/GLM-4.5's config.json (the published dialect; token ids left out).
PUBLISHED = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 151552,
}
FAMILY = Family(
    name="glm4_moe",
    hf_class="Glm4MoeForCausalLM",
    hf_config_class="Glm4MoeConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # 4 x 16 = 64: not hidden_size, as in the published models
        n_routed_experts=8,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    cases={
        # RoPE on 8 of 16 dims, q/k norms, q/k/v biases, 2 groups of which 1 is allowed (so a
        # group's score decides), one dense layer, one shared expert, scaled routed weights
        "partial_qknorm_groups": dict(
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
        # RoPE on 12 of 16 dims with YaRN (6 frequencies: the ramp falls between them), no
        # norms, no biases, two shared experts, a tied head, two dense layers, top-3
        # unnormalised
        "yarn_partial_shared2_tied": dict(
            partial_rotary_factor=0.75,
            rope=YARN,
            use_qk_norm=False,
            attention_bias=False,
            n_shared_experts=2,
            tie_word_embeddings=True,
            first_k_dense_replace=2,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        ),
    },
    moe_layers={"partial_qknorm_groups": [1, 2], "yarn_partial_shared2_tied": [2]},
    rope_parameter_keys=("partial_rotary_factor",),
    published=PUBLISHED,
    # keys a config.json leaves out take transformers' defaults, not ours
    absent_keys=(
        {"model_type": "glm4_moe", "num_attention_heads": 32},
        dict(
            head_dim=128,
            routed_scaling_factor=1.0,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
            rope_theta=10000.0,
            attention_bias=False,
        ),
    ),
    config_round_trips={
        "tiny_yarn_quarter_rotary_tied": dict(
            partial_rotary_factor=0.25, rope=YARN, tie_word_embeddings=True
        ),
    },
    aux=Aux.NONE,  # transformers' GLM-4.5 has none
    correction_bias_std=0.2,
    position_offset=3000,  # past YaRN's original 1024
    packed_case="partial_qknorm_groups",
    expert_width_field="moe_intermediate_size",
    # head_dim wide: partial rotary changes no matmul
    flops=Flops("partial_qknorm_groups", attention=6 * 3 * 4 * (16 + 16) * 64, aux_loss_coef=0.0),
    refusals={
        "model_type": Refusal(
            dict(model_type="deepseek_v3"), "model_type 'deepseek_v3', expected 'glm4_moe'"
        ),
        "hidden_act": Refusal(dict(hidden_act="gelu"), "hidden_act 'gelu'; only 'silu'"),
        "dropout": Refusal(dict(attention_dropout=0.1), "attention_dropout=0.1 .*set it to 0.0"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling .*'linear'.*remove"
        ),
        "groups": Refusal(
            dict(n_group=3), r"n_routed_experts \(160\) must split into model.n_group \(3\)"
        ),
        "odd_rotary": Refusal(
            dict(partial_rotary_factor=0.2), r"partial_rotary_factor \(int\(128 \* 0.2\) = 25\)"
        ),
    },
    bounds={"zero_width": ArgsProblems(dict(hidden_size=0), ("model.hidden_size must be > 0",))},
    cross_field={
        # partial 0.3 of 128 is 38 dims: even, so allowed; 0.25 of 12 is 3, odd
        "rotary_38_dims": ArgsProblems(dict(partial_rotary_factor=0.3), ()),
        "rotary_3_dims": ArgsProblems(
            dict(head_dim=12, partial_rotary_factor=0.25), ("must be even",)
        ),
    },
    train_argv=TRAIN_ARGV,
    layouts=TWO_RANK_LAYOUTS,
)
