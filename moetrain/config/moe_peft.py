"""The `[moe]` and `[peft]` sections of the job configuration: how routers are balanced
and which weights train (split out of `schema.py`, which holds the rest and `JobConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg


@dataclass
class MoESection:
    aux_loss_mode: str = arg(
        "micro_batch",
        "micro_batch (Switch loss on each forward's statistics) | global_batch (on the "
        "statistics of all data-parallel ranks' forwards of one accumulation round, so under "
        "accumulation it follows the data-parallel degree) | "
        "sequence (DeepSeek-V3's sequence-wise loss, mean over the batch's sequences)",
        choices=("micro_batch", "global_batch", "sequence"),
    )
    aux_loss_layers: str = arg(
        "per_layer",
        "per_layer (each MoE layer's balance loss on its own statistics, averaged over the "
        "layers: a layer's overload is pushed down in that layer) | pooled (statistics pooled "
        "over the layers before the product, Hugging Face's load_balancing_loss_func: one "
        "layer's overload cancels another's underload; f counts the top-k of the unbiased "
        "probabilities, not the experts a correction bias chose; for parity with transformers)",
        choices=("per_layer", "pooled"),
    )
    z_loss_coef: float = arg(
        0.0,
        "weight of the router z-loss (ST-MoE): mean over tokens of logsumexp(router "
        "logits)^2, averaged over the MoE layers; logged as z_loss either way (0 = off)",
        ge=0,
        note="0 = off",
    )
    bias_update_rate: float = arg(
        0.001,
        "aux-loss-free balancing (routers with a correction bias, e.g. DeepSeek-V3): at each "
        "step, bias += rate * sign(mean load - load) over the global batch (0 = frozen)",
        ge=0,
        note="0 freezes the bias",
    )
    capacity_factor: float | None = arg(
        None,
        "GShard-style expert capacity (tokens beyond it are dropped); None = drop-less",
        gt=0,
        note="none = drop-less",
    )
    gemm: str = arg(
        "auto",
        "expert GEMM: auto (torch._grouped_mm where supported) | grouped_mm | loop",
        choices=("auto", "grouped_mm", "loop"),
    )


@dataclass
class PeftSection:
    method: str = arg(
        "none",
        "none (train every weight) | lora (freeze the model; train low-rank adapters "
        "W + alpha/rank * B @ A on peft.targets, B starting at zero)",
        choices=("none", "lora"),
    )
    rank: int = arg(8, "LoRA rank r", ge=1)
    alpha: float = arg(16.0, "LoRA alpha: the update is scaled by alpha / rank", gt=0)
    dropout: float = arg(0.0, "dropout on the adapters' input (0 = off)", ge=0, lt=1)
    targets: list[str] = arg(
        ["attention", "experts"],
        "what gets adapters: attention (every linear projection of the attention blocks), "
        "experts (the routed experts, adapters stacked per expert and sharded like them), "
        "shared_experts",
        choices=("attention", "experts", "shared_experts"),
    )
    init_from: str | None = arg(
        None,
        "a peft adapter directory (adapter_config.json and adapter_model.safetensors: an "
        "`--adapters` export, or peft's save_pretrained) whose adapters this run starts from "
        "instead of the fresh init; its r, lora_alpha and targets must be this run's. Used "
        "only on a fresh start: a resume of this job's checkpoint takes its adapters",
    )
    base_dtype: str = arg(
        "fp32",
        "with peft.method=lora: the dtype the frozen base is held in. bf16 halves its bytes "
        "(the adapters, their gradients and optimizer state stay fp32, and so do the plan's "
        "fp32 modules, the routers); under train.mixed_precision=bf16 the forward computes "
        "the same as with fp32, which FSDP casts to bf16 anyway. With "
        "checkpoint.save_frozen=true the base is saved in bf16",
        choices=("fp32", "bf16"),
    )
