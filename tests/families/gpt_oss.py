"""GPT-OSS's table for the model suite (tests/families/family.py)."""

import torch
from torch import nn

from moetrain.models.gpt_oss.args import GptOssArgs
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

# openai/gpt-oss-20b's config.json, in its own dialect, without its quantization_config
# (the MXFP4 release; a dequantised checkpoint has the rest unchanged).
PUBLISHED = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "vocab_size": 201088,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.9,
}
MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"}


def _large_sinks(model: nn.Module, _generator: torch.Generator) -> None:
    """Sinks x20, so that some dominate their softmax and a dropped sink shows."""
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.mul_(20.0)


FAMILY = Family(
    name="gpt_oss",
    hf_class="GptOssForCausalLM",
    hf_config_class="GptOssConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=8,
        num_local_experts=6,
        max_position_embeddings=256,
        router_aux_loss_coef=0.01,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
        swiglu_limit=1.5,  # low enough that the clamps bite at this init
        # transformers' default for 3 layers, written out as its config.json has it
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=10000.0,
        rope=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
    cases={
        # a 5-token window on layers 0 and 2 of a 17-token sequence; sinks x20: some dominate
        "window_gqa_top2": dict(num_key_value_heads=2, num_experts_per_tok=2, sliding_window=5),
        # a window longer than the sequence (no effect), every head its own K/V, top-3
        "long_window_mha_top3": dict(
            num_key_value_heads=4, num_experts_per_tok=3, sliding_window=64
        ),
        # MQA, layers in another order, a 3-token window
        "mqa_layer_types_top2": dict(
            num_key_value_heads=1,
            num_experts_per_tok=2,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
    },
    perturb_extra=_large_sinks,
    # layer_types left empty: the published alternation, which config.json spells out
    resolved_on_save={
        "layer_types": lambda args: [args.layer_type(i) for i in range(args.num_hidden_layers)]
    },
    published=PUBLISHED,
    published_args=lambda: GptOssArgs(
        num_hidden_layers=24,
        num_local_experts=32,
        layer_types=["sliding_attention", "full_attention"] * 12,
        router_aux_loss_coef=0.9,
    ),
    aux=Aux.POOLED,
    packed_case="window_gqa_top2",  # windows shorter and longer than a document
    expert_width_field="intermediate_size",
    # layers 0 and 2 see 5 of the 64 keys, layer 1 all
    flops=Flops(
        "window_gqa_top2", attention=6 * (2 * 5 / 64 + 1) * 4 * (8 + 8) * 64, aux_loss_coef=0.01
    ),
    refusals={
        "mxfp4": Refusal(
            dict(quantization_config=MXFP4), r"quantization_config \(mxfp4\).*dequantise"
        ),
    },
    bounds={"zero_width": ArgsProblems(dict(hidden_size=0), ("model.hidden_size must be > 0",))},
    cross_field={
        "layer_types": ArgsProblems(
            dict(layer_types=["full_attention"] * 3), ("model.layer_types has 3 entries",)
        ),
        "top_k": ArgsProblems(dict(num_experts_per_tok=129), ("model.num_experts_per_tok (129)",)),
    },
    train_argv=TRAIN_ARGV,
    # two pipeline stages, EP 2, CP 2, CP 2 x EP 2 (plain FSDP: every other layout shards
    # within it)
    layouts={
        "pp2": Layout(2, ("--parallel.pp=2",)),
        "ep2": Layout(2, (EP2,)),
        "cp2": Layout(2, (CP2,)),
        "cp2_ep2": Layout(2, (CP2, EP2)),
    },
)
