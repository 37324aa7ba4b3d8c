"""Hugging Face <-> native Qwen3-MoE: config.json and weight names.

Native names are HF's without the leading "model.", except the routed experts, which
HF checkpoints store per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and we
store stacked: `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
`mlp.experts.down_proj [E, H, I]`. Checkpoints that already hold the stacked form
(transformers-5 in-memory names) are read too.
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.hf_names import PrefixedStackedNames
from moetrain.models.common.hf_rope import rope_config, rope_kwargs
from moetrain.models.qwen3_moe.args import Qwen3MoeArgs

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads rms_norm_eps max_position_embeddings "
    "num_experts_per_tok norm_topk_prob decoder_sparse_step tie_word_embeddings "
    "router_aux_loss_coef initializer_range attention_bias"
).split()
# transformers' Qwen3MoeConfig defaults for keys a config.json may leave out, where they
# differ from ours (the published Qwen3-30B-A3B's 48 layers and renormalised top-k): what
# transformers would build from that file.
_HF_DEFAULTS = {"num_hidden_layers": 24, "norm_topk_prob": False}


def args_from_hf_config(cfg: dict) -> Qwen3MoeArgs:
    """Both dialects: published (`rope_theta`, `rope_scaling`, `num_experts`) and
    transformers-5 (`rope_parameters: {rope_type, rope_theta, ...}`, possibly
    `num_local_experts`); RoPE plain or YaRN (moetrain.models.common.hf_rope)."""
    if cfg.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise HFFormatError(
            f"config.json has model_type {cfg['model_type']!r}, expected 'qwen3_moe'"
        )
    if cfg.get("use_sliding_window"):
        raise HFFormatError("use_sliding_window=true is not supported (Qwen3-MoE ships it off)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"hidden_act {cfg['hidden_act']!r} is not supported, only 'silu'")
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    kwargs = {**_HF_DEFAULTS, **kwargs}
    kwargs.setdefault("max_position_embeddings", 32768)  # transformers' default
    # A missing rope_theta is transformers' Qwen3MoeConfig.default_theta.
    kwargs.update(rope_kwargs(cfg, kwargs["max_position_embeddings"], default_theta=10000.0))
    kwargs["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    # transformers' head_dim default: hidden_size / heads, each at its own default if absent
    width, heads = cfg.get("hidden_size", 2048), cfg.get("num_attention_heads", 32)
    kwargs["head_dim"] = cfg.get("head_dim") or width // heads
    kwargs["mlp_only_layers"] = list(cfg.get("mlp_only_layers") or [])
    return Qwen3MoeArgs(**kwargs)


def load_hf_config(model_dir: str) -> Qwen3MoeArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: Qwen3MoeArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json content in the transformers-5 dialect (older versions read rope_theta and
    rope_scaling)."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=args.head_dim,
        num_experts=args.num_experts,
        mlp_only_layers=list(args.mlp_only_layers),
        hidden_act="silu",
        **rope_config(args),
        use_sliding_window=False,
        sliding_window=None,
        attention_dropout=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.num_experts, args.moe_intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
)
is_redundant_key = _NAMES.is_redundant_key
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
