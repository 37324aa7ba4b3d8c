"""Hugging Face <-> native GPT-OSS: config.json and weight names.

Native names are HF's without the leading "model.", except:
- the router, `mlp.gate` (HF: `mlp.router`);
- the experts: HF stores `gate_up_proj [E, H, 2I]` in (in, out) orientation with gate and
  up *interleaved* on the last dim (gate at even columns) and its bias `[E, 2I]` likewise,
  `down_proj [E, I, H]`; native is (out, in), gate rows then up rows: `gate_up_proj
  [E, 2I, H]`, `gate_up_proj_bias [E, 2I]`, `down_proj [E, H, I]`.
Reads take only a rank's part (its experts, its rows) from disk. The published releases
store the experts in MXFP4 (`*_blocks`, `*_scales`, `quantization_config`): refused with the
fix (dequantise to bf16 first).
"""

from __future__ import annotations

import torch

from moetrain.models import HFFormatError, read_config_json
from moetrain.models.gpt_oss.args import GptOssArgs
from moetrain.models.spec import GetSlice, HasKey

_SAME_NAME_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads head_dim num_local_experts num_experts_per_tok sliding_window "
    "rms_norm_eps max_position_embeddings swiglu_alpha swiglu_limit router_aux_loss_coef "
    "initializer_range tie_word_embeddings"
).split()
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
_DEQUANTIZE = (
    "dequantise it to bf16 first, e.g. load it with transformers' "
    "GptOssForCausalLM.from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True)) "
    "and save_pretrained to a new directory"
)


def args_from_hf_config(cfg: dict) -> GptOssArgs:
    """Both dialects: published (`rope_scaling`, `rope_theta`) and transformers-5
    (`rope_parameters`); an MXFP4-quantised release is refused."""
    if cfg.get("model_type", "gpt_oss") != "gpt_oss":
        raise HFFormatError(f"config.json has model_type {cfg['model_type']!r}, expected 'gpt_oss'")
    quant = cfg.get("quantization_config") or {}
    if quant:
        raise HFFormatError(
            f"config.json has a quantization_config ({quant.get('quant_method', '?')}): the "
            f"experts are stored quantised, which this trainer does not read; {_DEQUANTIZE}"
        )
    if cfg.get("attention_dropout", 0.0):
        raise HFFormatError("attention_dropout must be 0.0: the trainer has no attention dropout")
    if not cfg.get("attention_bias", True):
        raise HFFormatError("attention_bias=false is not GPT-OSS; this model has q/k/v/o biases")
    kwargs = {k: cfg[k] for k in _SAME_NAME_KEYS if k in cfg}
    if "num_local_experts" not in kwargs and "num_experts" in cfg:
        kwargs["num_local_experts"] = cfg["num_experts"]
    if cfg.get("layer_types"):
        kwargs["layer_types"] = list(cfg["layer_types"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kwargs["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 150000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise HFFormatError(f"RoPE type {rope_type!r} is not supported, only default or yarn")
    kwargs["rope_type"] = rope_type
    if rope_type == "yarn":
        for key in _YARN_KEYS:
            if rope.get(key) is not None:
                kwargs[f"rope_{key}"] = rope[key]
    for key in (
        "swiglu_alpha",
        "swiglu_limit",
        "rms_norm_eps",
        "rope_factor",
        "rope_beta_fast",
        "rope_beta_slow",
    ):
        if key in kwargs:
            kwargs[key] = float(kwargs[key])  # JSON may write 7 for 7.0
    return GptOssArgs(**kwargs)


def load_hf_config(model_dir: str) -> GptOssArgs:
    return args_from_hf_config(read_config_json(model_dir))


def hf_config_dict(args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the transformers-5 dialect (`rope_theta` and `rope_scaling` too)."""
    cfg = {k: getattr(args, k) for k in _SAME_NAME_KEYS}
    rope = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.rope_type == "yarn":
        rope.update({k: getattr(args, f"rope_{k}") for k in _YARN_KEYS})
    cfg.update(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        layer_types=[args.layer_type(i) for i in range(args.num_hidden_layers)],
        attention_bias=True,
        attention_dropout=0.0,
        hidden_act="silu",
        rope_theta=args.rope_theta,
        rope_parameters=rope,
        rope_scaling=rope if args.rope_type == "yarn" else None,
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


def _hf_name(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace(".mlp.gate.", ".mlp.router.")


def _expert_param(name: str) -> str | None:
    prefix, _, param = name.rpartition(".")
    if prefix.endswith(".mlp.experts"):
        return param
    return None


def hf_keys(name: str, shape: tuple[int, ...], args: GptOssArgs, has: HasKey) -> dict:
    hf = _hf_name(name)
    if _expert_param(name) is not None and has(hf + "_blocks"):
        raise HFFormatError(
            f"checkpoint holds {hf}_blocks: the experts are MXFP4-quantised; {_DEQUANTIZE}"
        )
    if _expert_param(name) in ("gate_up_proj", "down_proj"):  # (out, in) <-> (in, out)
        return {hf: (shape[0], shape[2], shape[1])}
    return {hf: tuple(shape)}


def _interleaved(rows: slice, intermediate: int) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """Native gate/up rows [a, b) of [0, 2I) -> the contiguous HF column range that holds
    them, and where in it the gate rows and the up rows sit."""
    start, stop, _ = rows.indices(2 * intermediate)
    native = torch.arange(start, stop)
    hf_cols = torch.where(native < intermediate, 2 * native, 2 * (native - intermediate) + 1)
    lo, hi = (int(hf_cols.min()), int(hf_cols.max()) + 1) if len(hf_cols) else (0, 0)
    return slice(lo, hi), hf_cols - lo, native


def from_hf(
    name: str, args: GptOssArgs, has: HasKey, get: GetSlice, index: tuple[slice, ...]
) -> torch.Tensor:
    hf, param = _hf_name(name), _expert_param(name)
    if param is None or param == "down_proj_bias":
        return get(hf, index)
    inter = args.intermediate_size
    if param == "down_proj":  # native [E, H, I][e, r, c] = HF [E, I, H][e, c, r]
        experts, rows, cols = index
        return get(hf, (experts, cols, rows)).transpose(1, 2)
    if param == "gate_up_proj_bias":
        experts, rows = index
        cols, pick, _ = _interleaved(rows, inter)
        return get(hf, (experts, cols))[:, pick]
    experts, rows, cols = index  # gate_up_proj: native [E, 2I, H][e, r, c] = HF [e, c, col(r)]
    hf_cols, pick, _ = _interleaved(rows, inter)
    return get(hf, (experts, cols, hf_cols))[:, :, pick].transpose(1, 2)


def to_hf(name: str, tensor: torch.Tensor, args: GptOssArgs) -> dict[str, torch.Tensor]:
    hf, param = _hf_name(name), _expert_param(name)
    if param == "down_proj":
        return {hf: tensor.transpose(1, 2).contiguous()}
    if param in ("gate_up_proj", "gate_up_proj_bias"):
        gate, up = tensor.chunk(2, dim=1)  # [E, I, ...] each
        woven = torch.stack([gate, up], dim=2).flatten(1, 2)  # rows gate0, up0, gate1, ...
        return {hf: woven.transpose(1, 2).contiguous() if param == "gate_up_proj" else woven}
    return {hf: tensor}


def is_redundant_key(key: str, args: GptOssArgs, has: HasKey) -> bool:
    """A tied model's head, which some exporters write anyway."""
    return key == "lm_head.weight" and args.tie_word_embeddings
