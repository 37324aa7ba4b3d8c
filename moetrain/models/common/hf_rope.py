"""Hugging Face's RoPE keys <-> `YaRNArgs` (moetrain.models.common.rope_args): both config.json
dialects, published (`rope_theta` + `rope_scaling: {type: yarn, ...}`) and transformers-5
(`rope_parameters: {rope_type, rope_theta, ...}`)."""

from __future__ import annotations

from typing import Any

from moetrain.models import HFFormatError

YARN_KEYS = (
    "factor original_max_position_embeddings beta_fast beta_slow mscale mscale_all_dim truncate"
).split()


def rope_kwargs(cfg: dict, max_len: int, *, default_theta: float) -> dict[str, Any]:
    """The args' rope_* values from a config.json (`max_len`: its max_position_embeddings,
    which YaRN's missing keys default from, as in transformers).

    `default_theta`: the model's `rope_theta` where config.json has none, stated by each
    model as transformers' config class for its model type has it (`default_theta`; 10,000
    for most, 500,000 for ERNIE-4.5, 1,000,000 for Mixtral): a missing key means what it
    means to transformers (tests/test_model_contract.py checks every model's)."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    kwargs: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", default_theta)))
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise HFFormatError(
            f"config.json's {key} has RoPE type {rope_type!r}; only default and yarn are "
            f"supported: remove {key}'s scaling to train at the original context length"
        )
    kwargs["rope_type"] = rope_type
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None:
            raise HFFormatError("an explicit YaRN attention_factor is not supported")
        for key in YARN_KEYS:
            if rope.get(key) is not None:
                kwargs[f"rope_{key}"] = rope[key]
        # Missing keys mean what they mean to transformers: the original length defaults
        # to max_position_embeddings, and the factor to their ratio.
        original = rope.get("original_max_position_embeddings") or max_len
        kwargs["rope_original_max_position_embeddings"] = original
        if rope.get("factor") is None:
            kwargs["rope_factor"] = max_len / original
    return kwargs


def rope_config(args: Any) -> dict[str, Any]:
    """config.json's RoPE keys for `args`: `rope_parameters` (transformers-5), plus the
    published `rope_theta` and, for YaRN, `rope_scaling` that older readers use."""
    rope = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    scaling = None
    if args.rope_type == "yarn":
        yarn = {k: getattr(args, f"rope_{k}") for k in YARN_KEYS}
        if not args.rope_mscale:  # unset: written as absent, as transformers reads None
            del yarn["mscale"]
        rope.update(yarn)
        scaling = {"type": "yarn", "rope_type": "yarn", **yarn}
    return {"rope_theta": args.rope_theta, "rope_parameters": rope, "rope_scaling": scaling}
