"""Hugging Face <-> native DeepSeek-V3: config.json and weight names.

Native names are HF's without the leading "model.", except:
- routed experts, stacked (see moetrain.models.common.hf_experts; per-expert keys in HF files);
- the MTP modules `mtp.{k}.*`, which the released checkpoints store as an extra decoder
  layer `model.layers.{L + k}.*` (L = num_hidden_layers) with `enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm`, and copies of the embedding and head (`embed_tokens`,
  `shared_head.head`) that we write on export and skip on import (ours are shared);
- `tokens_per_expert` (the bias update's running counts), which has no HF counterpart.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.common.hf_experts import MLP_EXPERTS
from moetrain.models.common.hf_rope import rope_config, rope_kwargs
from moetrain.models.deepseek_v3.args import DeepseekV3Args

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "n_routed_experts n_shared_experts num_experts_per_tok n_group topk_group norm_topk_prob "
    "routed_scaling_factor first_k_dense_replace rms_norm_eps max_position_embeddings "
    "tie_word_embeddings initializer_range attention_bias rope_interleave"
).split()
_NO_HF = "tokens_per_expert"


def args_from_hf_config(cfg: dict) -> DeepseekV3Args:
    """Both dialects: published (`rope_theta` + `rope_scaling: {type: yarn, ...}`) and
    transformers-5 (`rope_parameters: {rope_type, rope_theta, ...}`)."""
    if cfg.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise HFFormatError(
            f"config.json has model_type {cfg['model_type']!r}, expected 'deepseek_v3'"
        )
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, want) != want:
            raise HFFormatError(f"config.json has {key}={cfg[key]!r}; DeepSeek-V3 uses {want!r}")
    if cfg.get("quantization_config"):
        raise HFFormatError(
            "config.json has a quantization_config (the released DeepSeek-V3 weights are fp8 "
            "with *.weight_scale_inv tensors); dequantize them to bf16 first"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"hidden_act {cfg['hidden_act']!r} is not supported, only 'silu'")
    heads = cfg.get("num_attention_heads")
    if cfg.get("num_key_value_heads") not in (None, heads):
        raise HFFormatError(
            f"config.json has num_key_value_heads={cfg['num_key_value_heads']} but MLA keys and "
            f"values have num_attention_heads={heads} heads; set them equal"
        )
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    kwargs.setdefault("max_position_embeddings", 4096)  # transformers' default
    kwargs["q_lora_rank"] = cfg.get("q_lora_rank") or 0
    # NOTE: num_nextn_predict_layers is not read: transformers writes num_mtp_layers=1
    # without saving MTP weights, and MTP training is opt-in (a job config key).
    # A missing rope_theta is transformers' DeepseekV3Config.default_theta.
    kwargs.update(rope_kwargs(cfg, kwargs["max_position_embeddings"], default_theta=10000.0))
    return DeepseekV3Args(**kwargs)


def load_hf_config(model_dir: str) -> DeepseekV3Args:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: DeepseekV3Args, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the transformers-5 dialect, plus the published keys older readers use
    (`rope_theta`, and `rope_scaling` for YaRN)."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    cfg.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        q_lora_rank=args.q_lora_rank or None,
        num_key_value_heads=args.num_attention_heads,
        num_nextn_predict_layers=args.num_nextn_predict_layers,
        **rope_config(args),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        hidden_act="silu",
        attention_dropout=0.0,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


_MTP = re.compile(r"mtp\.(\d+)\.(.*)")


def _hf_name(name: str, args: DeepseekV3Args) -> str:
    if name.startswith("lm_head."):
        return name
    mtp = _MTP.fullmatch(name)
    if mtp is None:
        return "model." + name
    layer, rest = args.num_hidden_layers + int(mtp[1]), mtp[2]
    rest = rest.removeprefix("block.")
    if rest == "norm.weight":
        rest = "shared_head.norm.weight"
    return f"model.layers.{layer}.{rest}"


def is_redundant_key(key: str, args: DeepseekV3Args, has: Callable[[str], bool]) -> bool:
    """Checkpoint keys the model does not need but a valid checkpoint may hold: a tied
    head's copy, the MTP layers' copies of embedding and head, and MTP layers beyond
    `num_nextn_predict_layers` (as transformers ignores `model.layers.61.*`). Only layers
    that are MTP layers (they have `eh_proj`) are skipped: a config.json with fewer layers
    than the weights is still refused."""
    if key == "lm_head.weight" and args.tie_word_embeddings:
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", key)
    if layer is None or int(layer[1]) < args.num_hidden_layers:
        return False
    if not has(f"model.layers.{layer[1]}.eh_proj.weight"):
        return False
    if int(layer[1]) >= args.num_hidden_layers + args.num_nextn_predict_layers:
        return True
    return key.endswith((".embed_tokens.weight", ".shared_head.head.weight"))


def hf_keys(
    name: str, shape: tuple[int, ...], args: DeepseekV3Args, has: Callable[[str], bool]
) -> dict[str, tuple[int, ...]]:
    """The checkpoint keys that make native `name` of global `shape`, with their shapes."""
    if name.endswith(_NO_HF):
        return {}
    hf = _hf_name(name, args)
    mtp = _MTP.fullmatch(name)
    if mtp and not has(f"model.layers.{args.num_hidden_layers + int(mtp[1])}.eh_proj.weight"):
        raise HFFormatError(
            f"model.num_nextn_predict_layers={args.num_nextn_predict_layers}, but the checkpoint "
            f"has no MTP layer model.layers.{args.num_hidden_layers + int(mtp[1])} (no eh_proj; "
            "transformers does not save MTP weights); set model.num_nextn_predict_layers=0"
        )
    if has(hf) or not MLP_EXPERTS.is_stacked(hf):
        return {hf: tuple(shape)}
    return MLP_EXPERTS.per_expert_keys(hf, shape)


def from_hf(
    name: str,
    args: DeepseekV3Args,
    has: Callable[[str], bool],
    get: Callable[[str, tuple[slice, ...]], torch.Tensor],
    index: tuple[slice, ...],
) -> torch.Tensor:
    """The part `index` of native `name`, reading only that part of the checkpoint."""
    if name.endswith(_NO_HF):  # counts since the last bias update: none yet
        return torch.zeros([s.stop - s.start for s in index], dtype=torch.int64)
    hf = _hf_name(name, args)
    if has(hf):
        return get(hf, index)
    if MLP_EXPERTS.is_stacked(hf):
        width = args.moe_intermediate_size
        return MLP_EXPERTS.read_stacked(hf, args.n_routed_experts, width, get, index)
    raise HFFormatError(f"checkpoint has no tensor {hf!r} (needed for {name!r})")


def to_hf(name: str, tensor: torch.Tensor, args: DeepseekV3Args) -> dict[str, torch.Tensor]:
    """HF checkpoint entries for the full value of native `name`."""
    if name.endswith(_NO_HF):
        return {}
    hf = _hf_name(name, args)
    out = MLP_EXPERTS.split_stacked(hf, tensor) if MLP_EXPERTS.is_stacked(hf) else {hf: tensor}
    # The MTP layers of released checkpoints carry their own copy of embedding and head.
    head = name == "lm_head.weight" or (name == "embed_tokens.weight" and args.tie_word_embeddings)
    for k in range(args.num_nextn_predict_layers):
        layer = f"model.layers.{args.num_hidden_layers + k}"
        if name == "embed_tokens.weight":
            out[f"{layer}.embed_tokens.weight"] = tensor.clone()  # safetensors: no aliases
        if head:
            out[f"{layer}.shared_head.head.weight"] = tensor.clone()
    return out
