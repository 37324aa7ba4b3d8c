"""Our LoRA adapters <-> Hugging Face peft's adapter files, both ways: the export
(`moetrain.export.adapters`) and `peft.init_from` (`moetrain.checkpoint.initial_adapters`) share this map.

- An adapted nn.Linear is a peft `target_modules` entry: `<module>.lora_A.weight` [r, in]
  and `.lora_B.weight` [out, r], our orientation; the module is the base weight's HF key.
- Routed experts are peft `target_parameters` entries: transformers 5 holds each layer's
  experts as stacked parameters (Qwen3-MoE: `model.layers.N.mlp.experts.gate_up_proj`
  [E, 2I, H], `down_proj` [E, H, I], each expert's [out, in] as ours), and peft's
  ParamWrapper puts one low-rank update per expert on such a parameter, scaled alpha / r as
  ours: lora_A [E * r, in] is our A [E, r, in] with the experts' rows one after the other;
  lora_B [out, r * E] holds B_e's column j at column j * E + e (peft reads it back as
  [out, r, E]). So each expert's update B_e @ A_e is exact, not a rank r * E approximation.
- peft wraps the stacked parameters of one module one inside the other, in the order the
  module registers them (transformers' experts: gate_up_proj, then down_proj, as ours): the
  first one's adapters sit under one more `base_layer.` per parameter wrapped after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetrain.models import HFFormatError
from moetrain.models.common.lora import LoRAGroupedExperts, adapted_weights

# LoraConfig(target_parameters=...), which the stacked experts' adapters need.
MIN_PEFT = "0.17.0"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."  # peft's keys: the PeftModel's path to the base's modules


@dataclass
class Entry:
    """One tensor of the adapter file: our adapter's name and the two conversions."""

    native: str
    to_peft: Callable[[torch.Tensor], torch.Tensor]
    from_peft: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Layout:
    entries: dict[str, Entry]  # peft's key -> ours
    modules: list[str]  # target_modules (whole HF module names)
    parameters: list[str]  # target_parameters (HF names of stacked parameters)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def check_peft_version() -> None:
    """Refuse an installed peft without LoraConfig(target_parameters=...); with none
    installed the files are written all the same (they are plain safetensors and JSON)."""
    try:
        import peft
    except ImportError:
        return
    import inspect

    if "target_parameters" not in inspect.signature(peft.LoraConfig).parameters:
        raise HFFormatError(
            f"the installed peft {peft.__version__} cannot load adapters on stacked experts "
            f"(LoraConfig.target_parameters): upgrade to peft>={MIN_PEFT}, or export merged "
            "weights (without --adapters)"
        )


def _probe(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def _linear_key(adapter, name: str, shape: tuple[int, ...], args) -> str:
    """The one HF key of native weight `name`, when its HF form is the weight unchanged."""
    probe = _probe(shape)
    out = adapter.to_hf(name, probe, args)
    (key, value), *rest = out.items()
    if rest or not key.endswith(".weight") or not torch.equal(value, probe):
        raise HFFormatError(
            f"{name}: its Hugging Face form is not the weight as it is ({sorted(out)[:3]}), so "
            "its adapter has no peft form; export merged weights instead (without --adapters)"
        )
    return key.removesuffix(".weight")


def _stacked_key(adapter, name: str, shape: tuple[int, ...], args) -> str:
    """transformers 5's in-memory name of stacked expert weight `name` ("model." + ours),
    when the model's HF adapter reads a tensor of that name as ours unchanged: else that
    layout (e.g. [E, in, out], or gate and up interleaved) would need its adapters redone."""
    key, probe = "model." + name, _probe(shape)

    def get(k: str, index: tuple[slice, ...]) -> torch.Tensor:
        if k != key:
            raise HFFormatError(k)
        return probe[index]

    try:
        value = adapter.from_hf(name, args, lambda k: k == key, get, tuple(map(slice, shape)))
    except (HFFormatError, KeyError):
        value = None
    if value is None or not torch.equal(value, probe):
        raise HFFormatError(
            f"{name}: transformers does not hold it as {key} laid out as ours, so its adapters "
            "have no peft form here; export merged weights instead (without --adapters)"
        )
    return key


def peft_layout(model: nn.Module, adapter: Any, args: Any) -> Layout:
    """Where each of `model`'s adapters goes in peft's files (global shapes: the model may
    be on meta, or sharded)."""
    params = dict(model.named_parameters())
    experts = {fqn for fqn, m in model.named_modules() if isinstance(m, LoRAGroupedExperts)}
    layout = Layout({}, [], [])
    stacked: dict[str, list[tuple[str, str, str]]] = {}  # HF module -> its (A, B, HF name)
    for name, (a, b, _) in adapted_weights(model).items():
        shape = tuple(params[name].shape)
        if name.rpartition(".")[0] not in experts:
            module = _linear_key(adapter, name, shape, args)
            layout.modules.append(module)
            layout.entries[f"{module}.lora_A.weight"] = Entry(a, _same, _same)
            layout.entries[f"{module}.lora_B.weight"] = Entry(b, _same, _same)
            continue
        key = _stacked_key(adapter, name, shape, args)
        layout.parameters.append(key)
        stacked.setdefault(key.rpartition(".")[0], []).append((a, b, key))
    for module, wrapped in stacked.items():
        for i, (a, b, _) in enumerate(wrapped):  # adapted_weights: gate_up, then down
            at = f"{module}." + "base_layer." * (len(wrapped) - 1 - i)
            num_experts, rank, _ = params[a].shape
            out = params[b].shape[1]
            layout.entries[at + "lora_A.weight"] = Entry(
                a, lambda t: t.flatten(0, 1), lambda t, e=num_experts: t.unflatten(0, (e, -1))
            )
            layout.entries[at + "lora_B.weight"] = Entry(
                b,
                lambda t: t.permute(1, 2, 0).reshape(t.shape[1], -1),
                lambda t, e=num_experts, o=out: t.reshape(o, -1, e).permute(2, 0, 1),
            )
    return layout


def adapter_config(peft: dict, layout: Layout, base: str | None) -> dict:
    """adapter_config.json for `peft` (the run's [peft]): exact names, so peft adapts
    nothing else (a dense MLP's `gate_proj` where only the shared experts' were trained)."""
    import re

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": peft["rank"],
        "lora_alpha": peft["alpha"],
        # peft's ParamWrapper refuses any dropout; at inference dropout is the identity.
        "lora_dropout": 0.0 if layout.parameters else peft["dropout"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": base,
        # peft rejects target_modules=None beside target_parameters; [] adapts no module.
        "target_modules": "^(" + "|".join(re.escape(m) for m in layout.modules) + ")$"
        if layout.modules
        else [],
    }
    if layout.parameters:
        config["target_parameters"] = layout.parameters
    return config
