"""Loading: dataclass defaults < TOML file < `--section.key=value` overrides, then checks.

Values are converted to each field's type here (CLI strings parsed, TOML values only
checked); every problem found, from an unknown key to an impossible value, comes back
in one ConfigError so that a config is fixed in one round, not one error per launch.
"""

from __future__ import annotations

import math
import re
import types
from dataclasses import fields, is_dataclass
from typing import Any, NamedTuple, Union, get_args, get_origin

from moetrain.config.checks import config_problems
from moetrain.config.schema import (
    MODEL_OWN_KEYS,
    SECTIONS,
    JobConfig,
    ModelSection,
    field_types,
    key_fields,
    type_name,
)
from moetrain.config.suggest import closest_key
from moetrain.models import model_args_class, model_names
from moetrain.models.common.args import field_problems

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the same parser as the tomli package
    import tomli as tomllib


class ConfigError(Exception):
    """A config problem the user can fix; the message names the key(s) and the fix."""


class _Value(NamedTuple):
    value: Any  # typed when it comes from TOML, a raw string when from the command line
    origin: str  # the TOML path or the CLI option, so messages say where to fix it
    from_cli: bool


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from `--config FILE` and `--section.key[=]value` overrides."""
    errors: list[str] = []
    config_path, overrides = _parse_argv(argv, errors)
    raw: dict[str, dict[str, _Value]] = {name: {} for name in SECTIONS}
    if config_path is not None:
        _read_toml(config_path, raw, errors)
    for name, text in overrides:  # applied after the file, so the command line wins
        section, _, key = name.partition(".")
        if section in raw and key:
            raw[section][key] = _Value(text, f"--{name}", True)
        else:
            errors.append(_unknown(name, f"--{name}", _dotted_keys(*_all_args_classes())))
    cfg = _build(raw, errors)
    if cfg is None:
        raise ConfigError(_join(errors))
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Raise one ConfigError that lists every impossible value in `cfg` (types are right)."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(_join(problems))


def _parse_argv(argv: list[str], errors: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            errors.append(f"unexpected argument {arg!r}: use --section.key=value (see --help)")
            continue
        name, has_value, value = arg[2:].partition("=")
        if not has_value:  # `--key value`; nothing or another option next means no value
            if i == len(argv) or argv[i].startswith("--"):
                errors.append(f"option --{name} needs a value: --{name}=VALUE")
                continue
            value, i = argv[i], i + 1
        if name == "config":
            config_path = value
        else:
            overrides.append((name, value))
    return config_path, overrides


def _read_toml(path: str, raw: dict[str, dict[str, _Value]], errors: list[str]) -> None:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for section, table in doc.items():
        if section in raw and isinstance(table, dict):
            raw[section].update({k: _Value(v, path, False) for k, v in table.items()})
        elif section in raw:
            errors.append(f"'{section}' in {path} must be a table: a [{section}] header, then keys")
        elif isinstance(table, dict):
            hint = _did_you_mean(section, list(SECTIONS), "[{}]")
            sections = ", ".join(SECTIONS)
            errors.append(
                f"unknown section [{section}] in {path}{hint or '; sections: ' + sections}"
            )
        else:  # a key written above the first [section] header
            same = [k for k in _dotted_keys(*_all_args_classes()) if k.endswith(f".{section}")]
            hint = f" (did you mean '{same[0]}'?)" if same else ""
            errors.append(f"key '{section}' in {path} must be under a [section] header{hint}")


def _build(raw: dict[str, dict[str, _Value]], errors: list[str]) -> JobConfig | None:
    """Typed sections from the raw values, or None when `errors` is not empty."""
    # The model name decides which other [model] keys exist, so it is resolved first.
    own = {k: v for k, v in raw["model"].items() if k in MODEL_OWN_KEYS}
    model_values = _convert_items("model", ModelSection, own, [], errors)
    name = model_values.get("name", ModelSection().name)
    args_cls = None
    if "name" in own and "name" not in model_values:
        pass  # a wrong type, already reported
    elif name not in model_names():
        origin = own["name"].origin if "name" in own else "the default"
        known_models = ", ".join(model_names())
        errors.append(
            f"model.name: unknown model {name!r} (from {origin}); known models: {known_models}"
        )
    else:
        args_cls = model_args_class(name)
    known = _dotted_keys(*([args_cls] if args_cls else _all_args_classes()))
    values = {
        s: _convert_items(s, cls, raw[s], known, errors)
        for s, cls in SECTIONS.items()
        if s != "model"
    }
    args = None
    if args_cls is not None:
        model_args = {k: v for k, v in raw["model"].items() if k not in MODEL_OWN_KEYS}
        args = args_cls(**_convert_items("model", args_cls, model_args, known, errors))
    if errors:
        # Report the impossible values too, in this same round: each value that converted
        # is checked against its own bounds (relations between keys wait for a clean build).
        for s, cls in SECTIONS.items():
            if s != "model":
                errors += _given_problems(cls(**values[s]), s, values[s])
        if args is not None:
            errors += _given_problems(args, "model", model_args)
        return None
    values["model"] = {**model_values, "args": args}
    return JobConfig(**{s: cls(**values[s]) for s, cls in SECTIONS.items()})


def _given_problems(obj: Any, section: str, given: dict[str, Any]) -> list[str]:
    """Bound and choice problems of the keys the user set (not of the defaults)."""
    keys = {f"{section}.{k}" for k in given}
    return [p for p in field_problems(obj, section) if p.split(" ", 1)[0] in keys]


def _convert_items(
    section: str, cls: type, items: dict[str, _Value], known: list[str], errors: list[str]
) -> dict[str, Any]:
    """Typed values of `items` for the fields of `cls`; problems are appended to `errors`."""
    hints = field_types(cls)
    meta = {f.name: f.metadata for f in key_fields(cls)}
    out = {}
    for key, item in items.items():
        where = f"{section}.{key}"
        if key not in meta:
            errors.append(_unknown(where, item.origin, known))
            continue
        try:
            out[key] = _convert(item.value, hints[key], item.from_cli)
        except _TableError as err:
            errors.append(f"{where}{err} (from {item.origin})")
            continue
        except ValueError:
            expected = type_name(hints[key])
            errors.append(
                f"{where}: expected {expected}, got {_show(item.value)} (from {item.origin})"
                + _list_hint(where, hints[key], meta[key].get("choices"), item.from_cli)
            )
            continue
        # Checked here although `field_problems` checks choices too: only here is the
        # value's origin known, and a misspelt choice is fixed where it was written.
        choices = meta[key].get("choices")
        chosen = out[key] if isinstance(out[key], list) else [out[key]]
        if choices is not None and any(v not in choices for v in chosen):
            allowed = ", ".join(map(repr, choices))
            errors.append(f"{where}: {out.pop(key)!r} is not one of {allowed} (from {item.origin})")
    return out


def _convert(value: Any, tp: Any, from_cli: bool) -> Any:
    """`value` as type `tp`: CLI strings are parsed, TOML values only checked (ValueError)."""
    text = value.strip() if from_cli else ""
    if get_origin(tp) in (Union, types.UnionType):  # `X | None`
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported config field type {tp!r}")  # a bug, not a user error
        is_none = value is None or (from_cli and text.lower() in ("none", "null"))
        return None if is_none else _convert(value, inner[0], from_cli)
    if get_origin(tp) is list:
        if from_cli and text.startswith("["):  # TOML-style list: [1, 2, 3] or ["a", "b"]
            value, from_cli = _cli_list(text, get_args(tp)[0]), False
        elif from_cli:  # comma-separated: 1,2,3 (an empty string is an empty list)
            value = [part.strip() for part in text.split(",")] if text else []
        if not isinstance(value, list):
            raise ValueError(value)
        out = []
        for i, item in enumerate(value, start=1):
            try:
                out.append(_convert(item, get_args(tp)[0], from_cli))
            except _TableError as err:
                raise _TableError(f"[{i}]: {err}") from None
        return out
    if is_dataclass(tp):  # a table of a list of tables ([[data.mix]])
        return _convert_table(value, tp)
    if tp is bool and from_cli and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if tp in (int, float) and from_cli:
        value = tp(text)  # int("1.5") and float("abc") raise ValueError
    # Python's bool is an int, but `steps = true` is a mistake; an int is a fine float.
    ok = {bool: (bool,), str: (str,), int: (int,), float: (int, float)}.get(tp)
    if ok is None:
        raise TypeError(f"unsupported config field type {tp!r}")  # a bug, not a user error
    if isinstance(value, bool) is not (tp is bool) or not isinstance(value, ok):
        raise ValueError(value)
    if tp is float and not math.isfinite(value):
        raise ValueError(value)
    return float(value) if tp is float else value


# A word that stands for itself as a string in a bracketed list: no quote, bracket, comma or
# space, so that nothing is guessed at.
_BARE_WORD = re.compile(r"^[\w.\-/:+]+$")


def _cli_list(text: str, item_type: Any) -> list[Any]:
    """A bracketed list from the command line: TOML (`[1, 2]`, `["a", "b"]`), or, for a
    list of strings, bare words (`[a, b]`): what the shell leaves of `["a", "b"]` unquoted."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        words = [w.strip() for w in text[1:-1].split(",")] if text.endswith("]") else []
        if item_type is str and words and all(_BARE_WORD.match(w) for w in words):
            return words
        raise ValueError(text) from None


def _list_hint(where: str, tp: Any, choices: Any, from_cli: bool) -> str:
    """How a list key is written, for a list value that did not convert ("" for others)."""
    inner = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) is not list else [tp]
    if len(inner) != 1 or get_origin(inner[0]) is not list:
        return ""
    item = get_args(inner[0])[0]
    if item is str:
        a, b = list(choices)[:2] if choices and len(choices) > 1 else ("a", "b")
        plain, toml = f"{a},{b}", f'["{a}", "{b}"]'
    elif item in (int, float):
        plain, toml = "1,2", "[1, 2]"
    else:  # a list of tables: only a config file writes those
        return ""
    if from_cli:
        return f"; write a list as --{where}={plain}, or --{where}='{toml}' (quoted for the shell)"
    return f"; write a list as {where.split('.', 1)[1]} = {toml}"


class _TableError(ValueError):
    """A problem inside one table of a list of tables, worded for the user."""


def _convert_table(value: Any, cls: type) -> Any:
    if not isinstance(value, dict):
        raise _TableError(f"expected a table like {{path = ..., weight = ...}}, got {_show(value)}")
    hints, names = field_types(cls), [f.name for f in fields(cls)]
    unknown = [k for k in value if k not in names]
    if unknown:
        hint = _did_you_mean(unknown[0], names, "'{}'")
        raise _TableError(f"unknown key {unknown[0]!r}{hint}; a table has {', '.join(names)}")
    out = {}
    for key, item in value.items():
        try:
            out[key] = _convert(item, hints[key], False)
        except ValueError:
            raise _TableError(
                f"{key}: expected {type_name(hints[key])}, got {_show(item)}"
            ) from None
    return cls(**out)


def format_value(value: Any) -> str:
    """A value as written on the command line (how the help shows defaults)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


# --- Messages -----------------------------------------------------------------------------


def _all_args_classes() -> list[type]:
    return [model_args_class(n) for n in model_names()]


def _dotted_keys(*args_classes: type) -> list[str]:
    """Every valid `section.key`, the [model] ones including those of the given args classes."""
    keys = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in key_fields(cls)]
    for args_cls in args_classes:
        keys += [f"model.{f.name}" for f in fields(args_cls) if f"model.{f.name}" not in keys]
    return keys


def _unknown(dotted: str, origin: str, known: list[str]) -> str:
    if origin.startswith("--"):  # from the command line: answer in command-line syntax
        hint = _did_you_mean(dotted, known, "--{}") or "; see --help for the keys"
        return f"unknown option --{dotted}{hint}"
    return f"unknown key '{dotted}' in {origin}" + _did_you_mean(dotted, known, "'{}'")


def _did_you_mean(word: str, candidates: list[str], style: str) -> str:
    match = closest_key(word, candidates)
    return f" (did you mean {style.format(match)}?)" if match else ""


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else format_value(value)


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)
