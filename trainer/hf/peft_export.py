"""A LoRA checkpoint's adapters in the format Hugging Face `peft` loads
(`python -m trainer.hf.export --adapters`): `adapter_model.safetensors` and
`adapter_config.json`, to put on the base model with `PeftModel.from_pretrained`.

Keys: `base_model.model.<the base weight's Hugging Face key, less .weight>.lora_A.weight`
([r, in]) and `.lora_B.weight` ([out, r]): peft's orientation is ours. `target_modules` is
an exact pattern of the adapted modules, so peft adds no adapter elsewhere (a dense MLP's
`gate_proj` where only the shared experts' were trained). `lora_alpha` and `r` give peft
our scale, alpha / r.

NOTE: the routed experts' adapters have no peft form here: transformers fuses each layer's
experts into stacked parameters, which peft's `nn.Linear` LoRA cannot target; such a
checkpoint is refused with the fix (the merged export, or targets without experts). So is
a weight whose Hugging Face form rearranges ours (its adapter would need the same).

The directory is replaced whole (export_dir.py): no merged weights of an earlier export stay
beside the adapters for transformers to load instead of the base.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from models import HFFormatError
from models.common.lora import LoRAGroupedExperts, adapted_weights
from trainer.checkpoint.markers import read_trainer_state
from trainer.hf.export_dir import staged_export


def _hf_key(adapter, name: str, shape: tuple[int, ...], args) -> str:
    """The one HF key of native weight `name`, when its HF form is the weight unchanged."""
    probe = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    out = adapter.to_hf(name, probe, args)
    (key, value), *rest = out.items()
    if rest or not key.endswith(".weight") or not torch.equal(value, probe):
        raise HFFormatError(
            f"{name}: its Hugging Face form is not the weight as it is ({sorted(out)[:3]}), so "
            "its adapter has no peft form; export merged weights instead (without --adapters)"
        )
    return key.removesuffix(".weight")


@torch.no_grad()
def export_adapters(
    path: str, out_dir: str, dtype: torch.dtype, tokenizer: bool = True
) -> str | None:
    """Write checkpoint `path`'s adapters into `out_dir`, with the tokenizer its data was
    prepared with (`tokenizer`); returns the line that says which, or why none."""
    from trainer.hf.export import _build, _read, checkpoint_spec
    from trainer.hf.export_tokenizer import recorded_tokenizer, write_tokenizer

    spec, args = checkpoint_spec(path)
    config = read_trainer_state(path)["config"]
    peft = config.get("peft", {})
    if peft.get("method", "none") != "lora":
        raise HFFormatError(f"{path} holds no LoRA adapters (peft.method=none): nothing to export")
    with torch.device("meta"):
        model = _build(path, spec, args)
    experts = [fqn for fqn, m in model.named_modules() if isinstance(m, LoRAGroupedExperts)]
    if experts:
        raise HFFormatError(
            f"{path} has adapters on the routed experts ({experts[0]}, ...), which peft cannot "
            "load: transformers stacks each layer's experts into fused parameters and peft's "
            "LoRA targets nn.Linear modules; export merged weights (without --adapters), or "
            "train with peft.targets without experts"
        )
    params = dict(model.named_parameters())
    tensors, modules = {}, []
    for name, (a, b, _) in adapted_weights(model).items():
        module = _hf_key(spec.hf_adapter, name, tuple(params[name].shape), args)
        modules.append(module)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    values = {n: torch.empty(params[n].shape, dtype=params[n].dtype) for n in tensors.values()}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": peft["rank"],
        "lora_alpha": peft["alpha"],
        "lora_dropout": peft["dropout"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": config["model"].get("init_from_hf"),
        "target_modules": "^(" + "|".join(re.escape(m) for m in modules) + ")$",
    }
    record, line = recorded_tokenizer(path) if tokenizer else (None, None)  # before any work
    with staged_export(out_dir) as staging:  # replaces out_dir whole, once complete
        if record is not None:
            line = write_tokenizer(record, staging, path)
        _read(path, values)
        save_file(
            {key: values[n].to(dtype).contiguous() for key, n in tensors.items()},
            os.path.join(staging, "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        with open(os.path.join(staging, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f, indent=2)
    return line
