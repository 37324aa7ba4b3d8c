"""`train.py --help` and the resolved config as plain data (logged with each run)."""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, Field, asdict, fields, is_dataclass
from typing import Any

from moetrain.config.load import format_value
from moetrain.config.schema import (
    SECTIONS,
    JobConfig,
    ModelSection,
    field_types,
    key_fields,
    type_name,
)
from moetrain.models import model_args_class, model_names
from moetrain.models.common.args import bound_text

_USAGE = """\
usage: torchrun [--nproc_per_node=N] train.py --config FILE.toml [--section.key=value ...]

Each key is read from the dataclass default, then the TOML file ([section] tables),
then --section.key=value or --section.key value on the command line, the last winning.
Booleans: true/false/yes/no/1/0. Lists: 1,2,3 or [1, 2, 3]. none clears an optional key.
Keys with a range or a list of choices show it after their doc: [value >= 1], [one of: ...]."""

# textwrap breaks lines at ASCII whitespace only: a range joined with this stays on one
# line ("[value >=" then "0]" on the next reads badly); it is a space again once wrapped.
_KEEP = "\N{NO-BREAK SPACE}"


def format_help() -> str:
    """Usage, then every key with its default, type, doc and allowed values, the model
    keys of each registered model right below [model]."""
    groups = []
    for section, cls in SECTIONS.items():
        groups.append((f"[{section}]", section, cls))
        if cls is ModelSection:
            models = [(n, model_args_class(n)) for n in model_names()]
            groups += [(f"[model] keys of {n}", "model", args_cls) for n, args_cls in models]
    rows: list[tuple[str, str, str] | str] = []
    for title, section, cls in groups:
        rows += ["", title]
        for f in key_fields(cls):
            default = f.default_factory() if f.default is MISSING else f.default
            key = f"--{section}.{f.name}={format_value(default)}"
            rows.append((key, type_name(field_types(cls)[f.name]), _doc(f)))
    key_w = min(max(len(r[0]) for r in rows if isinstance(r, tuple)), 44)  # longer: own line
    type_w = max(len(r[1]) for r in rows if isinstance(r, tuple))
    lines = _USAGE.splitlines()
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        key = row[0]
        if len(key) > key_w:
            lines.append(f"  {key}")
            key = ""
        head = f"  {key:<{key_w}}  {row[1]:<{type_w}}  "
        text = textwrap.fill(row[2], 100, initial_indent=head, subsequent_indent=" " * len(head))
        lines.append(text.replace(_KEEP, " "))
    return "\n".join(lines) + "\n"


def _doc(f: Field) -> str:
    doc = f.metadata.get("help", "")
    if "choices" in f.metadata:
        doc += f" [one of: {', '.join(map(str, f.metadata['choices']))}]"
    bounds = bound_text(f.metadata)
    if bounds is not None:
        doc += " " + f"[value {bounds}]".replace(" ", _KEEP)
    return doc


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The resolved config as nested plain data, model args flattened into `model` as in TOML."""
    out = {f.name: asdict(getattr(cfg, f.name)) for f in fields(cfg)}
    del out["model"]["args"]
    if is_dataclass(cfg.model.args):
        out["model"].update(asdict(cfg.model.args))
    return out
