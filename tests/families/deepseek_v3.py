"""DeepSeek-V3's table for the model suite (tests/families/family.py). Its pooled aux
(transformers computes none), MTP and the published models' shipped configs are in
tests/test_deepseek_v3_hf.py."""

import json
from pathlib import Path
from typing import Any

from moetrain.models.deepseek_v3.args import DeepseekV3Args
from tests.families.family import ArgsProblems, Aux, Family, Flops, Refusal

# The published config.json of DeepSeek-V3 without `auto_map`, the token ids and the
# version keys; its fp8 quantization_config the reader refuses (a checkpoint converted to
# bf16 has the rest unchanged).
DATA = Path(__file__).parent.parent / "data"
DEEPSEEK_V3_CONFIG = json.loads((DATA / "deepseek_v3_config.json").read_text())
BF16 = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}

# YaRN with mscale != mscale_all_dim: cos/sin are scaled by their ratio and the softmax by
# mscale(factor, mscale_all_dim)^2, so both scales are checked.
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=1024,  # the ramp spans frequencies 1.4 to 4.4
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.8,
    mscale_all_dim=1.0,
)


def _to_native(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`q_lora_rank: null` (a plain q_proj) is 0 in ours: TOML has no null; MLA has no
    key/value heads of its own (config.json's must equal the query heads)."""
    native = {k: v for k, v in kwargs.items() if k != "num_key_value_heads"}
    return dict(native, q_lora_rank=kwargs["q_lora_rank"] or 0)


FAMILY = Family(
    name="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    hf_config_class="DeepseekV3Config",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # MLA: as many as the heads (transformers' default is 128)
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,  # 8 frequencies: enough for YaRN's ramp to fall between them
        v_head_dim=6,  # not qk_nope + qk_rope: the value width must be honoured
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    # Together these cover every option: query LoRA on/off, n_group 1/2/4, YaRN on/off (with
    # and without truncation), interleaved RoPE on/off, 1 and 2 shared experts, tied
    # embeddings, unnormalised top-k, attention biases, 2 dense layers, rms_norm_eps != the
    # latent norms'.
    cases={
        "qlora_group4": {},
        "plain_q_group1_shared2_tied": dict(
            q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, tie_word_embeddings=True
        ),
        "yarn_no_interleave_shared2": dict(rope=YARN, rope_interleave=False, n_shared_experts=2),
        "yarn_v3_mscale_no_truncate_plain_q": dict(
            rope=dict(YARN, mscale=1.0, truncate=False), q_lora_rank=None, n_group=2, topk_group=1
        ),
        "no_topk_norm_bias_eps_dense2": dict(
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            attention_bias=True,
            rms_norm_eps=1e-5,
            first_k_dense_replace=2,
            num_experts_per_tok=3,
        ),
    },
    moe_layers={"qlora_group4": [1, 2], "no_topk_norm_bias_eps_dense2": [2]},
    to_native=_to_native,
    published=BF16,
    # DeepSeek-V3's architecture is the defaults'; it was released with YaRN on
    published_args=lambda: DeepseekV3Args(
        rope_type="yarn", rope_factor=40.0, rope_mscale=1.0, rope_mscale_all_dim=1.0
    ),
    published_dialect_extra=dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=1,  # read as 0: MTP is opt-in
        aux_loss_alpha=0.001,
        seq_aux=True,
        moe_layer_freq=1,
        ep_size=1,
    ),
    aux=Aux.NONE,
    correction_bias_std=0.2,  # both libraries initialise them to 0
    position_offset=3000,  # past YaRN's original context, where interpolation matters
    packed_case="qlora_group4",
    expert_width_field="moe_intermediate_size",
    # MLA: query/key 8 + 16 wide, values 6
    flops=Flops("qlora_group4", attention=6 * 3 * 4 * (24 + 6) * 64, aux_loss_coef=0.0),
    refusals={
        "softmax_scoring": Refusal(dict(scoring_func="softmax"), "scoring_func='softmax'"),
        "kv_heads": Refusal(dict(num_key_value_heads=16), "num_key_value_heads=16"),
        "model_type": Refusal(dict(model_type="qwen3_moe"), "model_type"),
        "fp8_as_published": Refusal(
            dict(quantization_config=DEEPSEEK_V3_CONFIG["quantization_config"]),
            "dequantize them to bf16",
        ),
    },
    bounds={
        "zero_width": ArgsProblems(dict(hidden_size=0), ("model.hidden_size must be > 0",)),
    },
    cross_field={
        "odd_rope_dims": ArgsProblems(
            dict(qk_rope_head_dim=63), ("model.qk_rope_head_dim must be even",)
        ),
        "groups": ArgsProblems(
            dict(n_group=3), ("model.n_routed_experts (256) must split into model.n_group (3)",)
        ),
    },
    layouts_elsewhere=(
        "tests/test_layout_parity.py and tests/test_deepseek_v3_train.py (against a "
        "one-process reference)"
    ),
)
