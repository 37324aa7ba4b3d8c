"""Hugging Face <-> native OLMoE: config.json and weight names.

Native names are HF's without the leading "model.", except the routed experts, which HF
checkpoints store per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and we store
stacked: `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
`mlp.experts.down_proj [E, H, I]`. Checkpoints that already hold the stacked form
(transformers-5 in-memory names) are read too.
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.hf_names import PrefixedStackedNames
from moetrain.models.olmoe.args import OlmoeArgs

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "rms_norm_eps max_position_embeddings num_experts_per_tok norm_topk_prob clip_qkv "
    "tie_word_embeddings router_aux_loss_coef initializer_range attention_bias"
).split()
# transformers' OlmoeConfig default for a key a config.json leaves out, where it differs
# from ours (the published model's 1024).
_HF_DEFAULT_INTERMEDIATE_SIZE = 2048


def _rope_type(rope: dict | None) -> str:
    rope = rope or {}
    return rope.get("rope_type", rope.get("type", "default"))


def args_from_hf_config(cfg: dict) -> OlmoeArgs:
    """Both dialects: published (`rope_theta`, `rope_scaling: null`) and transformers-5
    (`rope_parameters: {rope_type, rope_theta}`; `num_local_experts` is its alias)."""
    if cfg.get("model_type", "olmoe") != "olmoe":
        raise HFFormatError(f"config.json has model_type {cfg['model_type']!r}, expected 'olmoe'")
    for key in ("rope_parameters", "rope_scaling"):
        if _rope_type(cfg.get(key)) != "default":
            raise HFFormatError(
                f"config.json has {key} of type {_rope_type(cfg[key])!r}; this OLMoE supports "
                "only the default (unscaled) RoPE: remove the scaling from config.json to "
                "train at the model's original context length"
            )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"hidden_act {cfg['hidden_act']!r} is not supported, only 'silu'")
    if cfg.get("attention_dropout", 0.0):
        raise HFFormatError(
            f"attention_dropout={cfg['attention_dropout']} is not supported (the trainer has no "
            "attention dropout); set it to 0.0 in config.json"
        )
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    kwargs.setdefault("intermediate_size", _HF_DEFAULT_INTERMEDIATE_SIZE)
    if kwargs.get("clip_qkv") is not None:
        kwargs["clip_qkv"] = float(kwargs["clip_qkv"])  # JSON may write 8 for 8.0
    # null (or absent) means as many key/value heads as query heads, as transformers reads it.
    kwargs["num_key_value_heads"] = cfg.get("num_key_value_heads") or kwargs.get(
        "num_attention_heads", OlmoeArgs().num_attention_heads
    )
    rope = cfg.get("rope_parameters") or {}
    kwargs["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kwargs["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts", 64))
    kwargs["head_dim"] = cfg.get("head_dim")  # None: hidden_size // num_attention_heads
    return OlmoeArgs(**kwargs)


def load_hf_config(model_dir: str) -> OlmoeArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: OlmoeArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json content in the transformers-5 dialect, with `rope_theta` also at the top
    level for older readers."""
    if args.resolved_head_dim * args.num_attention_heads != args.hidden_size:
        raise HFFormatError(
            f"model.head_dim={args.head_dim} with {args.num_attention_heads} heads is not "
            f"hidden_size={args.hidden_size} wide: transformers' OLMoE sizes q_norm by "
            "hidden_size and cannot load it; unset model.head_dim to export to Hugging Face"
        )
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["OlmoeForCausalLM"],
        model_type="olmoe",
        num_key_value_heads=args.num_key_value_heads,
        num_experts=args.num_experts,
        hidden_act="silu",
        rope_theta=args.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        attention_dropout=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    if args.head_dim is not None:  # unset stays unset, so the round trip is exact
        cfg["head_dim"] = args.head_dim
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.num_experts, args.intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
)
is_redundant_key = _NAMES.is_redundant_key
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
