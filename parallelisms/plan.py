"""Resolve a model's ParallelPlan (FQN patterns) to its modules."""

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
