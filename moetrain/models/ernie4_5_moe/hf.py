"""Hugging Face <-> native ERNIE-4.5 MoE: config.json and weight names.

Native names are HF's without the leading "model.", except (all stated as data for
`PrefixedStackedNames`):
- the routed experts, stored per expert in HF checkpoints
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and stacked here (`moetrain.models.common.hf_experts`);
- the routing bias, `mlp.gate.e_score_correction_bias [E]` here, which the checkpoint keeps
  as `mlp.moe_statics.e_score_correction_bias [1, E]` (transformers-5's in-memory name,
  `mlp.gate.moe_statics.e_score_correction_bias`, is read too);
- `mlp.gate.tokens_per_expert` (the bias update's running counts): no checkpoint key;
- the released checkpoints' MTP weights (keys with "mtp"), which transformers ignores on
  load (`_keys_to_ignore_on_load_unexpected`), and so do we.
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.args import field_problems
from moetrain.models.common.hf_names import Moved, PrefixedStackedNames
from moetrain.models.common.hf_rope import rope_config, rope_kwargs
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs

# Keys read and written under their own name. A key config.json leaves out takes
# transformers' default, which for every one of them is our default (the published
# 21B-A3B's values, and moe_layer_end_index = -1).
_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads rms_norm_eps max_position_embeddings use_bias "
    "moe_num_experts moe_k moe_num_shared_experts moe_layer_start_index moe_layer_end_index "
    "moe_layer_interval moe_norm_min tie_word_embeddings router_aux_loss_coef initializer_range"
).split()
# Ernie4_5_MoeConfig's aliases (`attribute_map`): a config.json may use either name.
_ALIASES = {"moe_num_experts": "num_experts", "moe_k": "num_experts_per_tok"}
_HF_DEFAULT_THETA = 500_000.0  # Ernie4_5_MoeConfig.default_theta, for a file without one


def args_from_hf_config(cfg: dict) -> Ernie45MoeArgs:
    """Both dialects: published (`rope_theta` at the top level) and transformers-5
    (`rope_parameters: {rope_type, rope_theta, ...}`); RoPE plain or YaRN."""
    if cfg.get("model_type", "ernie4_5_moe") != "ernie4_5_moe":
        raise HFFormatError(
            f"config.json has model_type {cfg['model_type']!r}, expected 'ernie4_5_moe'"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"config.json has hidden_act {cfg['hidden_act']!r}; only 'silu' is supported"
        )
    defaults = Ernie45MoeArgs()
    kwargs = {}
    for key in _SAME_NAME_KEYS:
        value = cfg.get(key, cfg.get(_ALIASES.get(key, key)))
        kwargs[key] = getattr(defaults, key) if value is None else value
    kwargs["head_dim"] = (
        cfg.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    )
    kwargs.update(
        rope_kwargs(cfg, kwargs["max_position_embeddings"], default_theta=_HF_DEFAULT_THETA)
    )
    args = Ernie45MoeArgs(**kwargs)
    # Refused here, naming config.json's keys, rather than inside the model's constructor.
    problems = field_problems(args, "model") or args.validate()
    if problems:
        raise HFFormatError(
            "config.json gives values ERNIE-4.5 cannot take: " + "; ".join(problems)
        )
    return args


def load_hf_config(model_dir: str) -> Ernie45MoeArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: Ernie45MoeArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the transformers-5 dialect, plus the published `rope_theta` older
    readers use. `moe_layer_end_index` is written as the args hold it (transformers turns
    -1 into the last layer's index when it reads the file, and saves that)."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["Ernie4_5_MoeForCausalLM"],
        model_type="ernie4_5_moe",
        head_dim=args.head_dim,
        hidden_act="silu",
        **rope_config(args),
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.moe_num_experts, args.moe_intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
    moved=(
        Moved(
            "mlp.gate.e_score_correction_bias",
            "mlp.moe_statics.e_score_correction_bias",
            leading_ones=1,
            aliases=("mlp.gate.moe_statics.e_score_correction_bias",),
        ),
    ),
    no_checkpoint=("tokens_per_expert",),
    ignored=("mtp",),
)
is_redundant_key = _NAMES.is_redundant_key
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
