"""Fields of the hyper-parameter dataclasses (models' args and the job config sections).

Each field carries a one-line doc (`train.py --help` prints it) and, optionally, the
range of values a run can use; `field_problems` checks every bounded field of an
instance in one generic pass, so no dataclass writes its own loop of range checks.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any


def arg(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple | None = None,
    note: str | None = None,
    only_with: tuple[str, Any] | None = None,
) -> Any:
    """A dataclass field with a doc and optional bounds (ge: >=, gt: >, le: <=, lt: <) or
    choices. `note` is appended to a bound's error, e.g. "0 = off". None values (optional
    keys left unset) are never checked. `only_with=(key, value)`: the field acts only while
    field `key` holds `value` (YaRN's factor under `rope_type = "yarn"`), so a value other
    than its default is refused otherwise: set but ignored."""
    meta: dict[str, Any] = {"help": doc}
    given = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "only_with": only_with}
    for key, value in given.items():
        if value is not None:
            meta[key] = value
    if note is not None:
        meta["note"] = note
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def embedding_init_std() -> Any:
    """The field every model's args share: the token embedding's init std (see
    docs/parallelisms.md, "Weights that do not depend on the layout")."""
    return arg(
        0.0,
        "std of the token embedding's init; 0 = initializer_range (Hugging Face's). 1.0 "
        "(torchtitan's) keeps each token's identity in the residual stream at a random init, "
        "where with 0.02 attention's running mean, shared by all positions, outweighs the "
        "embedding from the second block on and every router picks the same experts",
        ge=0,
    )


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def bound_text(meta: dict[str, Any]) -> str | None:
    """The allowed range of a field as words ('>= 1', 'in [0, 1)'), None when unbounded."""
    low = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    high = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if low and high:
        return f"in {low[0]}{_fmt(low[1])}, {_fmt(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_fmt(low[1])}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {_fmt(high[1])}"
    return None


def _in_range(value: float, meta: dict[str, Any]) -> bool:
    return (
        ("ge" not in meta or value >= meta["ge"])
        and ("gt" not in meta or value > meta["gt"])
        and ("le" not in meta or value <= meta["le"])
        and ("lt" not in meta or value < meta["lt"])
    )


def _ignored(obj: Any, f: Any, section: str) -> str | None:
    """The problem of field `f` holding a value other than its default while the field it
    acts with (`only_with`) does not hold the value it needs, else None."""
    needed = f.metadata.get("only_with")
    if needed is None:
        return None
    other, wanted = needed
    value, actual = getattr(obj, f.name), getattr(obj, other)
    if actual == wanted or value == f.default:
        return None
    return (
        f"{section}.{f.name}={value} has no effect with {section}.{other}={actual}: it acts "
        f"only with {section}.{other}={wanted}; set {section}.{other}={wanted}, or leave "
        f"{section}.{f.name} at its default ({f.default})"
    )


def field_problems(obj: Any, section: str) -> list[str]:
    """'<section>.<key> must be ..., got ...' for every field of dataclass `obj` whose value
    is outside its bounds or choices (list fields: each element is checked), and for every
    field set where it has no effect (`only_with`)."""
    problems = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if (ignored := _ignored(obj, f, section)) is not None:
            problems.append(ignored)
        meta, key = f.metadata, f"{section}.{f.name}"
        values = value if isinstance(value, list) else [value]
        choices = meta.get("choices")
        if choices is not None and any(v not in choices for v in values):
            allowed = ", ".join(map(str, choices))
            problems.append(f"{key} must be one of {allowed}, got {value!r}")
        text = bound_text(meta)
        if text is not None and not all(_in_range(v, meta) for v in values):
            note = f" ({meta['note']})" if "note" in meta else ""
            problems.append(f"{key} must be {text}{note}, got {value}")
    return problems
