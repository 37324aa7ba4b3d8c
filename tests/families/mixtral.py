"""Mixtral's table for the model suite (tests/families/family.py)."""

from tests.families.family import (
    TRAIN_ARGV,
    TWO_RANK_LAYOUTS,
    ArgsProblems,
    Aux,
    Family,
    Flops,
    Refusal,
)

# mistralai/Mixtral-8x7B-v0.1's config.json (the published dialect), whose values our
# defaults are.
PUBLISHED = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

FAMILY = Family(
    name="mixtral",
    hf_class="MixtralForCausalLM",
    hf_config_class="MixtralConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=8,
        num_local_experts=6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        router_aux_loss_coef=0.02,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    cases={
        # a 5-token window on every layer of a 17-token sequence, 2 query heads per K/V head
        "window_gqa_top2": dict(num_key_value_heads=2, num_experts_per_tok=2, sliding_window=5),
        # full attention, every head its own K/V, a tied head, head_dim 12 != 32 / 4, top-3
        "mha_tied_top3": dict(
            num_key_value_heads=4, num_experts_per_tok=3, tie_word_embeddings=True, head_dim=12
        ),
    },
    published=PUBLISHED,
    # Absent keys mean transformers' defaults, which are not all the published values.
    absent_keys=(
        {"model_type": "mixtral", "num_attention_heads": 16},
        dict(
            max_position_embeddings=131072,
            router_aux_loss_coef=0.001,
            num_key_value_heads=16,
            head_dim=256,
            rope_theta=1e6,
        ),
    ),
    aux=Aux.POOLED,
    packed_case="window_gqa_top2",  # documents longer and shorter than the 5-token window
    expert_width_field="intermediate_size",
    # a query sees at most `sliding_window` of the 64 keys
    flops=Flops(
        "window_gqa_top2", attention=6 * 3 * (5 / 64) * 4 * (8 + 8) * 64, aux_loss_coef=0.02
    ),
    refusals={
        "model_type": Refusal(dict(model_type="mistral"), "model_type"),
        "hidden_act": Refusal(dict(hidden_act="gelu"), "hidden_act 'gelu'.*only 'silu'"),
        "jitter": Refusal(
            dict(router_jitter_noise=0.01), "router_jitter_noise=0.01.*set it to 0.0"
        ),
        "dropout": Refusal(dict(attention_dropout=0.1), "attention_dropout=0.1.*set it to 0.0"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_scaling of type 'linear'.*remove the scaling",
        ),
        "yarn": Refusal(
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "rope_parameters of type 'yarn'",
        ),
    },
    bounds={
        "width_window_aux": ArgsProblems(
            dict(hidden_size=0, sliding_window=0, router_aux_loss_coef=-0.1),
            (
                "model.hidden_size must be > 0",
                "model.sliding_window must be > 0",
                "router_aux_loss_coef must be >= 0 (0 = off)",
            ),
        ),
    },
    cross_field={
        "heads_head_dim_top_k": ArgsProblems(
            dict(num_key_value_heads=5, head_dim=7, num_experts_per_tok=9),
            ("multiple of model.num_key_value_heads", "even for RoPE", "num_experts_per_tok (9)"),
        ),
    },
    # a window of 24 (configs/debug_mixtral.toml) shorter than the 64-token sequence
    train_argv=(
        *(a for a in TRAIN_ARGV if not a.startswith(("--train.global", "--data.max_tokens"))),
        "--train.global_batch_size=4",
        "--data.max_tokens=100000",
    ),
    layouts=TWO_RANK_LAYOUTS,
)
