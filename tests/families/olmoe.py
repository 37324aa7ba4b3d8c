"""OLMoE's table for the model suite (tests/families/family.py)."""

from tests.families.family import (
    CP2,
    EP2,
    TRAIN_ARGV,
    ArgsProblems,
    Aux,
    Family,
    Flops,
    Layout,
    Refusal,
)

CLIP = 0.8  # below the typical |q|, |k| (rms 1 after their norms) and |v|: clamping bites

# allenai/OLMoE-1B-7B-0924's config.json (the published dialect), whose values our
# defaults are.
PUBLISHED = {
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}

FAMILY = Family(
    name="olmoe",
    hf_class="OlmoeForCausalLM",
    hf_config_class="OlmoeConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    cases={
        "gqa_topk_norm": dict(norm_topk_prob=True),
        "mha_tied": dict(norm_topk_prob=False, num_key_value_heads=4, tie_word_embeddings=True),
        "gqa_clip_bias": dict(norm_topk_prob=False, clip_qkv=CLIP, attention_bias=True),
        "mqa_clip_tied_topk_norm": dict(
            norm_topk_prob=True, num_key_value_heads=1, clip_qkv=CLIP, tie_word_embeddings=True
        ),
    },
    published=PUBLISHED,
    # transformers' own defaults for absent keys (intermediate_size 2048, kv heads = heads)
    absent_keys=(
        {"model_type": "olmoe", "num_attention_heads": 8},
        dict(intermediate_size=2048, num_key_value_heads=8),
    ),
    config_round_trips={
        "tiny_clip_tied": dict(clip_qkv=2.5, tie_word_embeddings=True, norm_topk_prob=True),
        "explicit_head_dim": dict(head_dim=8, attention_bias=True),  # = hidden / heads
    },
    aux=Aux.POOLED,
    packed_case="gqa_clip_bias",
    expert_width_field="intermediate_size",
    flops=Flops("gqa_topk_norm", attention=6 * 3 * 4 * (8 + 8) * 64, aux_loss_coef=0.01),
    refusals={
        "model_type": Refusal(dict(model_type="llama"), "model_type"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_scaling.*'linear'.*remove the scaling",
        ),
        "yarn": Refusal(
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.*'yarn'"
        ),
        "hidden_act": Refusal(dict(hidden_act="gelu"), "hidden_act"),
    },
    bounds={
        "width_clip_aux": ArgsProblems(
            dict(hidden_size=0, clip_qkv=-1.0, router_aux_loss_coef=-0.1),
            (
                "model.hidden_size must be > 0",
                "model.clip_qkv must be > 0",
                "router_aux_loss_coef must be >= 0 (0 = off)",
            ),
        ),
    },
    cross_field={
        "heads_width_top_k": ArgsProblems(
            dict(
                num_attention_heads=6,
                num_key_value_heads=4,
                hidden_size=100,
                num_experts_per_tok=65,
            ),
            (
                "multiple of model.num_key_value_heads",
                "hidden_size (100) must be a multiple",
                "num_experts_per_tok (65)",
            ),
        ),
        "odd_head_dim": ArgsProblems(
            dict(hidden_size=48, num_attention_heads=16), ("even for RoPE",)
        ),
    },
    # Global batch 8 = micro 2 x 2 data-parallel ranks x 2 micro-batches (the pp run); seq_len
    # 64 splits into the 2 * cp pieces of the zigzag layout.
    train_argv=TRAIN_ARGV,
    layouts={
        "pp2_ep2": Layout(4, ("--parallel.pp=2", EP2)),  # 4 ranks in 2 pipeline stages with EP 2
        "cp2": Layout(2, (CP2,)),
    },
)
