"""Both sides of a family's parity checks, built from its table: transformers' model (eager,
fp32, norms and biases perturbed off their init) and ours, natively or through the trainer's
own Hugging Face loader."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import torch
from torch import nn

from moetrain.hf.weights import load_hf_weights
from moetrain.models import get_model_spec
from moetrain.models.common.moe import MoE, MoEOptions
from moetrain.models.spec import ModelSpec
from tests.families.family import Family, native_kwargs

SEQ = 17  # tokens of a parity sequence (a window of 5 or 3 is shorter)


def spec_of(family: Family) -> ModelSpec:
    return get_model_spec(family.name)


def native_args(family: Family, case: str) -> Any:
    """Our args for `case`, built from the table, not through the adapter."""
    return spec_of(family).args_cls(**native_kwargs(family, family.cases[case]))


def hf_config(transformers: ModuleType, family: Family, overrides: dict[str, Any]):
    kwargs = dict(family.base, **overrides)
    rope = {
        "rope_type": "default",
        **kwargs.pop("rope", {}),
        "rope_theta": kwargs.pop("rope_theta"),
    }
    for key in family.rope_parameter_keys:
        if key in kwargs:
            rope[key] = kwargs.pop(key)
    cfg = getattr(transformers, family.hf_config_class)(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    return cfg


def published_dialect(family: Family, v5: dict) -> dict:
    """The transformers-5 config.json `v5` rewritten as the released checkpoints write it:
    rope_theta and rope_scaling (`type`) instead of rope_parameters, and their own keys."""
    published = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    published["rope_theta"] = rope.pop("rope_theta")
    for key in family.rope_parameter_keys:
        if key in rope:
            published[key] = rope.pop(key)
    rope_type = rope.pop("rope_type")
    published["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    return published | family.published_dialect_extra


@torch.no_grad()
def perturb(family: Family, model: nn.Module, seed: int) -> None:
    """Init leaves norms at 1, biases and routing biases at 0, under which a norm over the
    wrong width, a dropped bias or an ignored correction bias would all go unseen."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ("norm" in name or name.endswith("bias")) and "correction_bias" not in name:
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    if family.correction_bias_std:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(family.correction_bias_std * torch.randn(t.shape, generator=g))
    if family.perturb_extra is not None:
        family.perturb_extra(model, g)


def hf_model(transformers: ModuleType, family: Family, case: str, seed: int = 0) -> nn.Module:
    cfg = hf_config(transformers, family, family.cases[case])
    torch.manual_seed(seed)
    model = getattr(transformers, family.hf_class)(cfg).eval()
    perturb(family, model, seed + 1)
    return model


def ours_from_dir(family: Family, model_dir, **overrides: Any) -> nn.Module:
    """Ours from a Hugging Face directory, through the trainer's own loader."""
    spec = spec_of(family)
    args = dataclasses.replace(spec.hf_adapter.load_hf_config(str(model_dir)), **overrides)
    model = spec.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, spec.hf_adapter, args, str(model_dir))
    return model.eval()


def native_model(family: Family, args: Any, seed: int = 3) -> nn.Module:
    """Ours from `args`, initialised as the trainer does and perturbed (training mode)."""
    model = spec_of(family).build(args, MoEOptions(gemm="loop"))
    model.init_weights(seed=seed)
    perturb(family, model, seed + 1)
    return model


def token_ids(family: Family, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, family.base["vocab_size"], shape, generator=g)


def positions(family: Family, seq: int) -> torch.Tensor:
    """[2, seq]: the second sequence from `position_offset` (past YaRN's original length)."""
    return torch.arange(seq) + torch.tensor([[0], [family.position_offset]])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def our_moe_layers(model: nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]


def their_moe_layers(model: nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def counted_routing(model: nn.Module) -> list[torch.Tensor]:
    """The routers' assignment counts (the bias update's `tokens_per_expert`)."""
    return [b for n, b in model.named_buffers() if n.endswith("tokens_per_expert")]
