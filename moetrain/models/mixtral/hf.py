"""Hugging Face <-> native Mixtral: config.json and weight names.

Native names are transformers-5's in-memory names without the leading "model.". The
checkpoints (the published ones, and what transformers' `save_pretrained` writes) keep the
original layout: the MoE at `block_sparse_moe` (router `block_sparse_moe.gate.weight`) and
each expert's projections as `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2`
(down). Both differences are data for `PrefixedStackedNames`, which stacks the experts into
`mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `down_proj [E, H, I]`.
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.hf_experts import ExpertNaming
from moetrain.models.common.hf_names import PrefixedStackedNames
from moetrain.models.mixtral.args import MixtralArgs

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "rms_norm_eps max_position_embeddings sliding_window num_local_experts "
    "num_experts_per_tok tie_word_embeddings router_aux_loss_coef initializer_range"
).split()
# transformers' MixtralConfig defaults for keys a config.json may leave out, where they differ
# from ours (the published Mixtral-8x7B-v0.1's 32768 and 0.02): what transformers would build
# from that file.
_HF_DEFAULTS = {"max_position_embeddings": 4096 * 32, "router_aux_loss_coef": 0.001}


def _rope_type(rope: dict | None) -> str:
    rope = rope or {}
    return rope.get("rope_type", rope.get("type", "default"))


def _refuse_what_we_would_ignore(cfg: dict) -> None:
    """Keys whose value changes transformers' Mixtral but that this model does not
    implement: accepting them would train another model than the file describes."""
    if cfg.get("model_type", "mixtral") != "mixtral":
        raise HFFormatError(f"config.json has model_type {cfg['model_type']!r}, expected 'mixtral'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"config.json has hidden_act {cfg['hidden_act']!r}; this Mixtral's experts are "
            "SwiGLU: only 'silu' is supported"
        )
    if cfg.get("router_jitter_noise"):
        raise HFFormatError(
            f"config.json has router_jitter_noise={cfg['router_jitter_noise']}: the trainer "
            "does not jitter the router's input; set it to 0.0 in config.json"
        )
    if cfg.get("attention_dropout"):
        raise HFFormatError(
            f"config.json has attention_dropout={cfg['attention_dropout']}: the trainer has "
            "no attention dropout; set it to 0.0 in config.json"
        )
    for key in ("rope_parameters", "rope_scaling"):
        if _rope_type(cfg.get(key)) != "default":
            raise HFFormatError(
                f"config.json has {key} of type {_rope_type(cfg[key])!r}; this Mixtral "
                "supports only the default (unscaled) RoPE: remove the scaling from "
                "config.json to train at the model's original context length"
            )


def args_from_hf_config(cfg: dict) -> MixtralArgs:
    """Both dialects: published (`rope_theta` at the top level) and transformers-5
    (`rope_parameters: {rope_type, rope_theta}`); `num_experts` is read as the alias
    transformers makes of `num_local_experts`."""
    _refuse_what_we_would_ignore(cfg)
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    for key, value in _HF_DEFAULTS.items():
        kwargs.setdefault(key, value)
    if "num_local_experts" not in kwargs and "num_experts" in cfg:
        kwargs["num_local_experts"] = cfg["num_experts"]
    defaults = MixtralArgs()
    heads = kwargs.get("num_attention_heads", defaults.num_attention_heads)
    # null (or absent) kv heads: as many as query heads; null head_dim: the width / heads
    # split. Both as transformers reads them.
    kwargs["num_key_value_heads"] = cfg.get("num_key_value_heads") or heads
    kwargs["head_dim"] = cfg.get("head_dim") or (
        kwargs.get("hidden_size", defaults.hidden_size) // max(heads, 1)
    )
    rope = cfg.get("rope_parameters") or {}
    kwargs["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    for key in ("rms_norm_eps", "router_aux_loss_coef", "initializer_range"):
        if key in kwargs:
            kwargs[key] = float(kwargs[key])  # JSON may write 1 for 1.0
    return MixtralArgs(**kwargs)


def load_hf_config(model_dir: str) -> MixtralArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: MixtralArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json content in the transformers-5 dialect, with `rope_theta` also at the top
    level for older readers. Every value is representable: nothing is refused."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        rope_theta=args.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.num_local_experts, args.intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
    experts=ExpertNaming(prefix="block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
    renames=(("mlp", "block_sparse_moe"),),
)
is_redundant_key = _NAMES.is_redundant_key
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
