"""Parameter-efficient fine-tuning (`[peft]`): LoRA adapters on the plan's modules, the rest
frozen.

`apply_lora` runs on the meta model before the parallel plan, so the plan shards adapters
like their base: a LoRALinear's adapters live in its block's FSDP unit, the routed experts'
stacked adapters are sharded on dim 0 over `ep` (and dim 1 over `efsdp`) with the experts.
Frozen parameters get no gradient, no optimizer state and no gradient reduction; the
optimizer and the grad norm see the adapters alone (`requires_grad`).

Which modules: `peft.targets` names kinds the model's plan locates (moetrain/models/common/plan.py):
`attention` (every nn.Linear under the parent of each `attention_core`), `experts`
(`routed_experts`), `shared_experts` (every nn.Linear under `shared_experts`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from moetrain.config import ConfigError
from moetrain.config.moe_peft import PeftSection
from moetrain.models.common.lora import LoRAGroupedExperts, LoRALinear, is_adapter
from moetrain.models.common.moe import GroupedExperts
from moetrain.models.common.plan import ParallelPlan
from moetrain.parallelisms.plan import match_modules
from moetrain.parallelisms.sharded_init import init_weights_global


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _linears_under(model: nn.Module, roots: list[str]) -> list[tuple[str, nn.Linear]]:
    return [
        (f"{root}.{name}", mod)
        for root in roots
        for name, mod in model.get_submodule(root).named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, LoRALinear)
    ]


def lora_targets(model: nn.Module, plan: ParallelPlan, peft: PeftSection, name: str) -> dict:
    """{fqn: module} of every module `peft.targets` gives adapters; ConfigError (naming the
    model and the fix) for a kind the model does not have or cannot take."""
    found: dict[str, nn.Module] = {}
    if "attention" in peft.targets:
        if plan.attention_core is None:
            raise ConfigError(f"peft.targets has attention, but model {name!r} has no attention")
        cores = match_modules(model, plan.attention_core, "attention_core")
        found.update(_linears_under(model, [fqn.rpartition(".")[0] for fqn, _ in cores]))
    # A plan may name modules that a configuration does not build (shared experts of
    # a model configured with none, routed experts of one whose layers are all dense).
    shared = match_modules(model, plan.shared_experts or (), "shared_experts", required=False)
    routed = match_modules(model, plan.routed_experts or (), "routed_experts", required=False)
    if "shared_experts" in peft.targets:
        if not shared:
            raise ConfigError(
                f"peft.targets has shared_experts, but model {name!r} as configured has no "
                "shared experts; remove shared_experts from peft.targets"
            )
        found.update(_linears_under(model, [fqn for fqn, _ in shared]))
    if "experts" in peft.targets:
        if not routed:
            raise ConfigError(
                f"peft.targets has experts, but model {name!r} as configured has no routed "
                "experts (every layer is dense); remove experts from peft.targets"
            )
        for fqn, experts in routed:
            if type(experts) is not GroupedExperts:
                raise ConfigError(
                    f"peft.targets has experts, but model {name!r}'s routed experts "
                    f"({type(experts).__name__}) have no LoRA form; remove experts from "
                    "peft.targets (attention and shared_experts still apply)"
                )
            found[fqn] = experts
    return found


def _adapted_shapes(fqn: str, module: nn.Module) -> list[tuple[str, int, int]]:
    """(weight name, out features, in features) of each weight a target's adapters update."""
    if isinstance(module, GroupedExperts):
        _, two_hidden, dim = module.gate_up_proj.shape
        _, _, hidden = module.down_proj.shape
        return [(f"{fqn}.gate_up_proj", two_hidden, dim), (f"{fqn}.down_proj", dim, hidden)]
    return [(f"{fqn}.weight", module.out_features, module.in_features)]


def check_rank(targets: dict[str, nn.Module], rank: int) -> None:
    """Refuse a rank above min(out, in) of an adapted weight: B @ A [out, in] has rank at most
    min(out, in), so a larger r adds adapter parameters (r * (out + in) per weight) and
    optimizer state without adding anything the update can express."""
    shapes = [shape for fqn, module in targets.items() for shape in _adapted_shapes(fqn, module)]
    if not shapes:
        return
    weight, out, inp = min(shapes, key=lambda s: min(s[1], s[2]))
    limit = min(out, inp)
    if rank > limit:
        raise ConfigError(
            f"peft.rank={rank} is above what the LoRA update of {weight} ([{out}, {inp}]) can "
            f"use: B @ A has rank at most {limit}, and a larger rank only adds parameters; set "
            f"peft.rank <= {limit}, or drop that module's kind from peft.targets"
        )


def apply_lora(model: nn.Module, plan: ParallelPlan, peft: PeftSection, name: str) -> int:
    """Give the targets adapters (their LoRA forms hold the same base Parameters) and freeze
    everything else. Returns the number of adapted modules."""
    targets = lora_targets(model, plan, peft, name)
    check_rank(targets, peft.rank)
    for fqn, module in targets.items():
        form = LoRAGroupedExperts if isinstance(module, GroupedExperts) else LoRALinear
        _swap(model, fqn, form.around(module, peft.rank, peft.alpha, peft.dropout))
    for param_name, param in model.named_parameters():
        param.requires_grad_(is_adapter(param_name))
    return len(targets)


def init_adapters(model: nn.Module, seed: int) -> None:
    """A ~ N(0, 1 / fan_in) (fan_in: the input features of the projection it reads), B = 0:
    the adapted model starts as its base. Layout-independent, like the base's init."""
    adapters = [(n, p) for n, p in model.named_parameters() if is_adapter(n)]
    std = {n: 1.0 / math.sqrt(p.shape[-1]) for n, p in adapters if n.endswith("lora_A")}

    def reset(name: str, tile: torch.Tensor, generator: torch.Generator) -> None:
        if name in std:
            tile.normal_(0.0, std[name], generator=generator)
        else:
            tile.zero_()

    init_weights_global(model, seed + 1, weights=adapters, reset=reset)


def hold_frozen_base(model: nn.Module, plan: ParallelPlan, peft: PeftSection) -> None:
    """`peft.base_dtype`: on the meta model after `apply_lora` and before the plan, so FSDP
    allocates each frozen shard in that dtype and every loader (init, Hugging Face weights,
    checkpoints) casts into it. Adapters keep fp32 (they train: fp32 masters and optimizer
    state). The plan's fp32 modules (routers) keep fp32 too: under bf16 mixed precision
    they are the only frozen weights FSDP does not round to bf16 for compute, so keeping
    them makes the bf16 base compute exactly what the fp32 base does there."""
    if peft.base_dtype == "fp32":
        return
    routers = match_modules(model, plan.fp32_modules, "fp32_modules", required=False)
    keep = {id(p) for _, module in routers for p in module.parameters()}
    for param in model.parameters():
        if not param.requires_grad and id(param) not in keep:
            # NOTE: in place, as Module.to does: tied weights stay one Parameter
            param.data = param.data.to(torch.bfloat16)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base inside: every LoRA module's adapters off, back as they
    were on leaving (DPO's reference, moetrain/loop/preference.py). A model without adapters
    runs as it is."""
    modules = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))]
    before = [m.adapters_enabled for m in modules]
    for module in modules:
        module.adapters_enabled = False
    try:
        yield
    finally:
        for module, enabled in zip(modules, before, strict=True):
            module.adapters_enabled = enabled
