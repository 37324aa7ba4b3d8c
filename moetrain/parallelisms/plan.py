"""Resolve a model's ParallelPlan (FQN patterns) to its modules, and check that a plan
describes its model (`check_plan`: every pattern names something, every seam is named)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # PlanError is a user error that train.py imports before torch
    from torch import nn


class PlanError(ValueError):
    pass


def _matches(pattern: str, fqn: str) -> bool:
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def match_modules(
    model: nn.Module, pattern: str | tuple[str, ...], what: str, required: bool = True
) -> list[tuple[str, nn.Module]]:
    """(fqn, module) pairs matching `pattern` ("*" = one name component), in model order;
    for a tuple of patterns, the matches of each pattern in turn.

    Matching nothing is an error: a plan that silently does nothing would leave the model
    unsharded or unparallelised without anyone noticing. (In a tuple, a pattern may match
    nothing when the others match: e.g. a model built without its optional MTP modules.)
    `required=False` allows an empty result (e.g. fp32 routers of a model with no MoE layer).
    """
    patterns = (pattern,) if isinstance(pattern, str) else pattern
    named = [(fqn, mod) for fqn, mod in model.named_modules() if fqn]
    found = [(fqn, mod) for p in patterns for fqn, mod in named if _matches(p, fqn)]
    if not found and required:
        examples = [fqn for fqn, _ in model.named_modules() if fqn][:6]
        raise PlanError(
            f"parallel plan: {what} pattern {pattern!r} matches no module of "
            f"{type(model).__name__} (module names look like {examples}); fix the model's PLAN"
        )
    return found


# The seams whose modules have a type of their own: the field must name every one of them.
_SEAM_TYPES = {
    "routed_experts": ("moetrain.models.common.moe", "RoutedExperts"),
    "routed_permute": ("moetrain.models.common.moe", "Permute"),
    "routed_sum": ("moetrain.models.common.moe", "Unpermute"),
    "attention_core": ("moetrain.models.common.attention", "AttentionCore"),
}
# Fields that only an MoE model fills (fp32_modules: the routers): a model built without
# routed experts (e.g. every layer dense) may leave them unmatched.
_MOE_FIELDS = ("routed_experts", "routed_permute", "routed_sum", "shared_experts", "fp32_modules")


def _patterns(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def check_plan(model: nn.Module, plan) -> None:
    """Refuse a plan that does not describe `model` (a `moetrain.models.common.plan.ParallelPlan`),
    on every layout, before any work: a pattern nothing matches is a typo or a stale name,
    and would leave something unsharded, unringed or unwrapped without a word.

    - every pattern of every field matches a module, except a pattern listed in
      `plan.optional` (modules some configurations do not build: a tied model's `lm_head`,
      DeepSeek-V3's `mtp.*`) and the patterns under an optional one that matched nothing;
      and the MoE fields of a model built without routed experts;
    - each seam field (routed_experts, routed_permute, routed_sum, attention_core) names
      every module of its seam's type: one left out would run unparallelised.
    """
    import importlib
    from dataclasses import fields

    named = [(fqn, mod) for fqn, mod in model.named_modules() if fqn]
    absent = [
        p for p in plan.optional if not any(_matches(p, fqn) for fqn, _ in named)
    ]  # optional patterns this configuration does not build
    seam_types = {
        f: getattr(importlib.import_module(module), cls) for f, (module, cls) in _SEAM_TYPES.items()
    }
    has_experts = any(isinstance(m, seam_types["routed_experts"]) for _, m in named)
    examples = [fqn for fqn, _ in named][:6]
    for field in fields(plan):
        if field.name == "optional":
            continue
        value = getattr(plan, field.name)
        for pattern in _patterns(value):
            if any(_matches(pattern, fqn) for fqn, _ in named):
                continue
            if pattern in plan.optional or any(pattern.startswith(a + ".") for a in absent):
                continue
            if field.name in _MOE_FIELDS and not has_experts:
                continue
            raise PlanError(
                f"parallel plan: {field.name} pattern {pattern!r} matches no module of "
                f"{type(model).__name__} (module names look like {examples}); fix the "
                "model's PLAN, or list the pattern in its `optional` if some configurations "
                "do not build that module"
            )
        seam = seam_types.get(field.name)
        if seam is None:
            continue
        named_by_field = {id(m) for _, m in match_modules(model, value or (), field.name, False)}
        missed = [fqn for fqn, m in named if isinstance(m, seam) and id(m) not in named_by_field]
        if missed:
            raise PlanError(
                f"parallel plan: {field.name} does not name {missed[:4]} ({seam.__name__} "
                f"modules of {type(model).__name__}); add a pattern for them to the model's PLAN"
            )
