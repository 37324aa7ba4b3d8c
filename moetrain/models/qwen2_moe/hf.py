"""Hugging Face <-> native Qwen2-MoE: config.json and weight names.

Native names are HF's without the leading "model.", except two, both stated as data in
`_NAMES`: the routed experts, which HF checkpoints store per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) and we store stacked
(`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows then up rows, and
`mlp.experts.down_proj [E, H, I]`), and the shared expert, `mlp.shared_experts` here (the
common `MoE`'s name, which the plan and LoRA target) and `mlp.shared_expert` in HF.
`mlp.shared_expert_gate` and the router `mlp.gate` keep HF's names. Checkpoints that
already hold the stacked form (transformers-5 in-memory names) are read too.
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.hf_names import PrefixedStackedNames
from moetrain.models.common.hf_rope import rope_config, rope_kwargs
from moetrain.models.qwen2_moe.args import Qwen2MoeArgs

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size "
    "shared_expert_intermediate_size num_hidden_layers num_attention_heads rms_norm_eps "
    "max_position_embeddings num_experts num_experts_per_tok norm_topk_prob "
    "decoder_sparse_step tie_word_embeddings qkv_bias router_aux_loss_coef initializer_range"
).split()
# transformers' Qwen2MoeConfig default for a key a config.json leaves out, where it differs
# from ours (the published Qwen1.5-MoE-A2.7B's 8192).
_HF_DEFAULT_MAX_POSITIONS = 32768


def _check_representable(cfg: dict) -> None:
    """Refuse, naming the key and the fix, what this model does not compute."""
    if cfg.get("model_type", "qwen2_moe") != "qwen2_moe":
        raise HFFormatError(
            f"config.json has model_type {cfg['model_type']!r}, expected 'qwen2_moe' "
            "(is this a Qwen2-MoE checkpoint? pick the matching model.name)"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"config.json has hidden_act {cfg['hidden_act']!r}; only 'silu' (SwiGLU) is supported"
        )
    # Sliding-window attention is off in every published Qwen2-MoE; transformers-5 also
    # states it per layer in layer_types.
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if cfg.get("use_sliding_window") or sliding:
        raise HFFormatError(
            "config.json asks for sliding-window attention (use_sliding_window: true or "
            "'sliding_attention' in layer_types), which this Qwen2-MoE does not support; set "
            "use_sliding_window to false (and drop layer_types) to train with full attention"
        )
    if cfg.get("attention_dropout", 0.0):
        raise HFFormatError(
            f"config.json has attention_dropout={cfg['attention_dropout']}; the trainer has no "
            "attention dropout: set it to 0.0"
        )
    heads = cfg.get("num_attention_heads", Qwen2MoeArgs().num_attention_heads)
    width = cfg.get("hidden_size", Qwen2MoeArgs().hidden_size) // max(heads, 1)
    if cfg.get("head_dim") not in (None, width):
        raise HFFormatError(
            f"config.json has head_dim={cfg['head_dim']}, not hidden_size / "
            f"num_attention_heads = {width}; Qwen2-MoE splits the width into its heads: "
            "remove head_dim from config.json"
        )


def args_from_hf_config(cfg: dict) -> Qwen2MoeArgs:
    """Both dialects: published (`rope_theta`, `rope_scaling`) and transformers-5
    (`rope_parameters: {rope_type, rope_theta, ...}`, `layer_types`); RoPE plain or YaRN
    (moetrain.models.common.hf_rope). A key the file leaves out means transformers' default."""
    _check_representable(cfg)
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    kwargs.setdefault("max_position_embeddings", _HF_DEFAULT_MAX_POSITIONS)
    # A missing rope_theta is transformers' Qwen2MoeConfig.default_theta.
    kwargs.update(rope_kwargs(cfg, kwargs["max_position_embeddings"], default_theta=10000.0))
    # null (or absent) means as many key/value heads as query heads, as transformers-4 read
    # it (transformers-5 would fail on null).
    kwargs["num_key_value_heads"] = cfg.get("num_key_value_heads") or kwargs.get(
        "num_attention_heads", Qwen2MoeArgs().num_attention_heads
    )
    kwargs["mlp_only_layers"] = list(cfg.get("mlp_only_layers") or [])
    return Qwen2MoeArgs(**kwargs)


def load_hf_config(model_dir: str) -> Qwen2MoeArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: Qwen2MoeArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json content in the transformers-5 dialect (older versions read rope_theta and
    rope_scaling, and ignore qkv_bias: they build q/k/v biases always)."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        num_key_value_heads=args.num_key_value_heads,
        mlp_only_layers=list(args.mlp_only_layers),
        hidden_act="silu",
        **rope_config(args),
        use_sliding_window=False,
        attention_dropout=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.num_experts, args.moe_intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
    renames=(("mlp.shared_experts", "mlp.shared_expert"),),
)
is_redundant_key = _NAMES.is_redundant_key
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
