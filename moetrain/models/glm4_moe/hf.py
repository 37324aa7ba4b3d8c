"""Hugging Face <-> native GLM-4.5 MoE: config.json and weight names.

Native names are HF's without the leading "model.", except:
- the routed experts, which HF checkpoints store per expert
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and we store stacked:
  `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
  `mlp.experts.down_proj [E, H, I]` (checkpoints holding the stacked form are read too);
- `mlp.gate.tokens_per_expert` (the bias update's running counts), which has no HF
  counterpart: nothing is written for it, and it starts at zero on import.
The released checkpoints' MTP layers (`model.layers.{L + k}`) are skipped on import.
"""

from __future__ import annotations

import re

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.args import field_problems
from moetrain.models.common.hf_names import PrefixedStackedNames
from moetrain.models.common.hf_rope import rope_config, rope_kwargs
from moetrain.models.glm4_moe.args import Glm4MoeArgs
from moetrain.models.spec import HasKey

# transformers' Glm4MoeConfig default of each key we read, for a config.json that leaves it
# out (they are mostly GLM-4.5-Air's, not our defaults, which are GLM-4.5's).
_HF_DEFAULTS = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    n_routed_experts=128,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
    use_qk_norm=False,
    num_nextn_predict_layers=1,
)
# Glm4MoeConfig's aliases (`attribute_map`): a config.json may use either name.
_ALIASES = {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"}
_HF_DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig sets it when config.json has none


def args_from_hf_config(cfg: dict) -> Glm4MoeArgs:
    """Both dialects: published (`rope_theta`, `partial_rotary_factor` at the top level,
    `rope_scaling: null`) and transformers-5 (`rope_parameters: {rope_type, rope_theta,
    partial_rotary_factor, ...}`); RoPE plain or YaRN."""
    if cfg.get("model_type", "glm4_moe") != "glm4_moe":
        raise HFFormatError(
            f"config.json has model_type {cfg['model_type']!r}, expected 'glm4_moe'"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"config.json has hidden_act {cfg['hidden_act']!r}; only 'silu' is supported"
        )
    if cfg.get("attention_dropout", 0.0):
        raise HFFormatError(
            f"config.json has attention_dropout={cfg['attention_dropout']} (the trainer has no "
            "attention dropout); set it to 0.0"
        )
    kwargs = {k: cfg.get(k, cfg.get(_ALIASES.get(k, k), d)) for k, d in _HF_DEFAULTS.items()}
    kwargs["head_dim"] = (
        cfg.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor", _HF_DEFAULT_PARTIAL_ROTARY_FACTOR)
    kwargs["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", partial))
    # A missing rope_theta is transformers' Glm4MoeConfig.default_theta.
    kwargs.update(rope_kwargs(cfg, kwargs["max_position_embeddings"], default_theta=10000.0))
    args = Glm4MoeArgs(**kwargs)
    # Refused here, naming config.json's keys, rather than inside the model's constructor.
    problems = field_problems(args, "model") or args.validate()
    if problems:
        raise HFFormatError("config.json gives values GLM-4.5 cannot take: " + "; ".join(problems))
    return args


def load_hf_config(model_dir: str) -> Glm4MoeArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: Glm4MoeArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the transformers-5 dialect, plus the published top-level keys older
    readers use (`rope_theta`, `partial_rotary_factor`, and `rope_scaling` for YaRN).

    NOTE: `num_nextn_predict_layers` is written as the args hold it, as transformers writes
    it without saving MTP weights: the export carries none either."""
    cfg = {k: getattr(args, k) for k in _HF_DEFAULTS}
    rope = rope_config(args)
    rope["rope_parameters"]["partial_rotary_factor"] = args.partial_rotary_factor
    cfg.update(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        head_dim=args.head_dim,
        partial_rotary_factor=args.partial_rotary_factor,
        **rope,
        hidden_act="silu",
        attention_dropout=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_NAMES = PrefixedStackedNames(
    expert_width=lambda args: (args.n_routed_experts, args.moe_intermediate_size),
    tied=lambda args: args.tie_word_embeddings,
    no_checkpoint=("tokens_per_expert",),  # counts since the last bias update
)
hf_keys = _NAMES.hf_keys
from_hf = _NAMES.from_hf
to_hf = _NAMES.to_hf
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_redundant_key(key: str, args: Glm4MoeArgs, has: HasKey) -> bool:
    """A tied model's head, and the released checkpoints' MTP layers.

    NOTE: GLM-4.5 ships `num_nextn_predict_layers` MTP layers as `model.layers.{L + k}.*`
    (L = num_hidden_layers: an attention + MoE block plus DeepSeek-V3's `eh_proj`, `enorm`,
    `hnorm`, `shared_head`), used for speculative decoding. transformers builds no MTP
    module and ignores them; so do we. Only a layer that is one (it has `eh_proj`) is
    skipped: a config.json with fewer layers than the weights is still refused."""
    if _NAMES.is_redundant_key(key, args, has):
        return True
    layer = _LAYER.match(key)
    if layer is None:
        return False
    i = int(layer[1])
    mtp = args.num_hidden_layers <= i < args.num_hidden_layers + args.num_nextn_predict_layers
    return mtp and has(f"model.layers.{i}.eh_proj.weight")
