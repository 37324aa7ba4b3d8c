"""Typed job configuration: one dataclass per TOML section.

Every field carries a one-line doc in `metadata["help"]`; `train.py --help` prints
them with their defaults. The `[model]` section holds `name`, `init_from_hf` and
the chosen model's own hyper-parameters (its `args_cls` from `models.get_model_spec`).
"""

from __future__ import annotations

import difflib
import math
import textwrap
import types
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from models import get_model_spec, model_names

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the same parser as the tomli package
    import tomli as tomllib


def _h(default, doc: str, choices: tuple | None = None):
    meta = {"help": doc}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSection:
    name: str = _h("run", "run name, shown in logs")
    output_dir: str = _h("outputs/run", "where metrics.jsonl (and later checkpoints) are written")


@dataclass
class ModelSection:
    name: str = _h("qwen3_moe", "model family (see models/__init__.py)")
    init_from_hf: str | None = _h(
        None, "Hugging Face model directory (config.json + safetensors) to start from"
    )
    # The chosen model's hyper-parameters (e.g. models.qwen3_moe.args.Qwen3MoeArgs),
    # filled from the other keys of [model].
    args: Any = None


@dataclass
class DataSection:
    source: str = _h(
        "stdlib",
        "stdlib (Python's own source files, no download) | text (glob of files) | "
        "jsonl (glob of JSON-lines files) | hf_datasets (datasets.load_dataset or load_from_disk)",
        choices=("stdlib", "text", "jsonl", "hf_datasets"),
    )
    path: str | None = _h(None, "glob (text/jsonl), or dataset name/directory (hf_datasets)")
    text_field: str = _h("text", "field that holds the document text (jsonl, hf_datasets)")
    hf_split: str = _h("train", "split to read (hf_datasets)")
    tokenizer: str = _h(
        "byte", "byte (256 byte ids + EOS, vocab 257) or a path to a tokenizer.json"
    )
    eos_token: str | None = _h(
        None, "EOS token string of a tokenizer.json tokenizer (default: a common one it contains)"
    )
    seq_len: int = _h(256, "tokens per training sample (documents are packed with EOS separators)")
    max_tokens: int | None = _h(
        None, "stop reading the source after this many tokens (None = read all of it)"
    )
    shuffle: bool = _h(True, "shuffle the sample order each epoch (seeded by train.seed)")
    num_workers: int = _h(0, "dataloader worker processes")


@dataclass
class TrainSection:
    steps: int = _h(100, "optimizer steps to run")
    seed: int = _h(0, "seed of weight init and data order (same seed -> same run on any layout)")
    global_batch_size: int = _h(8, "sequences per optimizer step, whatever the number of ranks")
    micro_batch_size: int = _h(
        1, "sequences per rank per forward; grad accumulation = global / (micro * dp ranks)"
    )
    lr: float = _h(3e-4, "peak learning rate")
    min_lr_ratio: float = _h(0.1, "final learning rate as a fraction of lr (cosine, wsd)")
    schedule: str = _h(
        "cosine",
        "cosine (warmup then cosine decay) | wsd (warmup, stable, decay) | constant (after warmup)",
        choices=("cosine", "wsd", "constant"),
    )
    warmup_steps: int = _h(10, "linear warmup steps from 0 to lr")
    decay_ratio: float = _h(0.2, "wsd: fraction of steps spent in the final linear decay")
    weight_decay: float = _h(0.1, "AdamW decoupled weight decay (not applied to norms)")
    beta1: float = _h(0.9, "AdamW beta1")
    beta2: float = _h(0.95, "AdamW beta2")
    eps: float = _h(1e-8, "AdamW epsilon")
    max_grad_norm: float = _h(1.0, "clip the global gradient L2 norm to this (0 = no clipping)")
    mixed_precision: str = _h(
        "auto",
        "auto (bf16 params/compute with fp32 reduce on CUDA, fp32 on CPU) | bf16 | fp32",
        choices=("auto", "bf16", "fp32"),
    )
    device: str = _h(
        "auto", "auto (cuda if available) | cuda | cpu", choices=("auto", "cuda", "cpu")
    )


@dataclass
class ParallelSection:
    dp_replicate: int = _h(1, "replicas of the sharded model (HSDP when > 1)")
    dp_shard: int = _h(-1, "FSDP shard degree; -1 = the rest of the world size")
    cp: int = _h(1, "context-parallel degree (sequence split across ranks)")
    ep: int = _h(1, "expert-parallel degree (borrows ranks from dp_shard * cp)")
    cp_layout: str = _h(
        "zigzag",
        "how the sequence is split over cp ranks: zigzag (rank r holds chunks r and 2cp-1-r: "
        "equal causal work) | contiguous (chunk r)",
        choices=("zigzag", "contiguous"),
    )
    cp_kernel: str = _h(
        "auto",
        "block kernel of ring attention: auto | cpu_flash (CPU, equal head dims) | math",
        choices=("auto", "cpu_flash", "math"),
    )


@dataclass
class MoESection:
    aux_loss_mode: str = _h(
        "micro_batch",
        "micro_batch (Switch loss on each forward's statistics) | global_batch (on the "
        "statistics of all data-parallel ranks' forwards of one accumulation round) | "
        "sequence (DeepSeek-V3's sequence-wise loss, mean over the batch's sequences)",
        choices=("micro_batch", "global_batch", "sequence"),
    )
    bias_update_rate: float = _h(
        0.001,
        "aux-loss-free balancing (routers with a correction bias, e.g. DeepSeek-V3): at each "
        "step, bias += rate * sign(mean load - load) over the global batch (0 = frozen)",
    )
    capacity_factor: float | None = _h(
        None, "GShard-style expert capacity (tokens beyond it are dropped); None = drop-less"
    )
    gemm: str = _h(
        "auto",
        "expert GEMM: auto (torch._grouped_mm where supported) | grouped_mm | loop",
        choices=("auto", "grouped_mm", "loop"),
    )


@dataclass
class CheckpointSection:
    interval: int = _h(0, "save every N steps (0 = no checkpoints)")
    resume: str = _h("auto", "auto (newest complete checkpoint) | none | PATH")
    keep_last: int = _h(0, "keep only the newest K checkpoints (0 = keep all)")
    async_save: bool = _h(False, "overlap the checkpoint write with training")


@dataclass
class MetricsSection:
    log_interval: int = _h(1, "log every N steps to the console and metrics.jsonl")
    jsonl: bool = _h(True, "append each logged step to <job.output_dir>/metrics.jsonl")
    expert_load_interval: int = _h(
        10, "every N steps, log tokens per expert of each MoE layer to metrics.jsonl (0 = never)"
    )
    progress: bool = _h(True, "show a progress bar with ETA on rank 0")


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    moe: MoESection = field(default_factory=MoESection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)


# --- Loading: dataclass defaults < TOML file < --section.key=value overrides -------------


class ConfigError(Exception):
    """A config problem the user can fix; the message names the key(s) and the fix."""


class _Value(NamedTuple):
    value: Any  # typed when it comes from TOML, a raw string when from the command line
    origin: str  # the TOML path or the CLI option, so messages say where to fix it
    from_cli: bool


_SECTIONS: dict[str, type] = get_type_hints(JobConfig)
# [model] keys that belong to ModelSection itself; every other key is a model hyper-parameter.
_MODEL_OWN_KEYS = tuple(f.name for f in fields(ModelSection) if f.name != "args")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
# data.source values that read from data.path, and what the path names for each.
_NEEDS_PATH = {
    "text": "a glob of text files",
    "jsonl": "a glob of JSON-lines files",
    "hf_datasets": "a dataset name or directory",
}


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from `--config FILE` and `--section.key[=]value` overrides.

    All problems found (unknown keys, wrong types, impossible values) come in one
    ConfigError, so a config is fixed in one round rather than one error per launch.
    """
    errors: list[str] = []
    config_path, overrides = _parse_argv(argv, errors)
    raw: dict[str, dict[str, _Value]] = {name: {} for name in _SECTIONS}
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
            hint = _did_you_mean(section, list(_SECTIONS), "[{}]")
            sections = ", ".join(_SECTIONS)
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
    own = {k: v for k, v in raw["model"].items() if k in _MODEL_OWN_KEYS}
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
        args_cls = get_model_spec(name).args_cls
    known = _dotted_keys(*([args_cls] if args_cls else _all_args_classes()))
    values = {
        s: _convert_items(s, cls, raw[s], known, errors)
        for s, cls in _SECTIONS.items()
        if s != "model"
    }
    if args_cls is None:
        return None
    model_args = {k: v for k, v in raw["model"].items() if k not in _MODEL_OWN_KEYS}
    args = args_cls(**_convert_items("model", args_cls, model_args, known, errors))
    if errors:
        return None
    values["model"] = {**model_values, "args": args}
    return JobConfig(**{s: cls(**values[s]) for s, cls in _SECTIONS.items()})


def _convert_items(
    section: str, cls: type, items: dict[str, _Value], known: list[str], errors: list[str]
) -> dict[str, Any]:
    """Typed values of `items` for the fields of `cls`; problems are appended to `errors`."""
    hints = _hints(cls)
    # ModelSection.args is built from the model keys, so it is not a key of its own.
    meta = {
        f.name: f.metadata for f in fields(cls) if not (cls is ModelSection and f.name == "args")
    }
    out = {}
    for key, item in items.items():
        where = f"{section}.{key}"
        if key not in meta:
            errors.append(_unknown(where, item.origin, known))
            continue
        try:
            out[key] = _convert(item.value, hints[key], item.from_cli)
        except ValueError:
            expected = _type_name(hints[key])
            errors.append(
                f"{where}: expected {expected}, got {_show(item.value)} (from {item.origin})"
            )
            continue
        choices = meta[key].get("choices")
        if choices is not None and out[key] not in choices:
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
            value, from_cli = tomllib.loads(f"v = {text}")["v"], False
        elif from_cli:  # comma-separated: 1,2,3 (an empty string is an empty list)
            value = [part.strip() for part in text.split(",")] if text else []
        if not isinstance(value, list):
            raise ValueError(value)
        return [_convert(v, get_args(tp)[0], from_cli) for v in value]
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


# --- Value checks: the types are right by now; these catch values no run can use -------


def validate(cfg: JobConfig) -> None:
    """Raise one ConfigError that lists every impossible value in `cfg`."""
    t, d, p, c = cfg.train, cfg.data, cfg.parallel, cfg.checkpoint
    problems: list[str] = []

    def need(ok: bool, problem: str) -> None:
        if not ok:
            problems.append(problem)

    at_least_one = {
        "train.steps": t.steps,
        "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size,
        "data.seq_len": d.seq_len,
        "metrics.log_interval": cfg.metrics.log_interval,
        "parallel.dp_replicate": p.dp_replicate,
        "parallel.cp": p.cp,
        "parallel.ep": p.ep,
    }
    for key, value in at_least_one.items():
        need(value >= 1, f"{key} must be >= 1, got {value}")
    need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    need(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    need(
        t.warmup_steps <= t.steps,
        f"train.warmup_steps ({t.warmup_steps}) must be <= train.steps ({t.steps})",
    )
    need(0 <= t.decay_ratio <= 1, f"train.decay_ratio must be in [0, 1], got {t.decay_ratio}")
    need(0 <= t.beta1 < 1, f"train.beta1 must be in [0, 1), got {t.beta1}")
    need(0 <= t.beta2 < 1, f"train.beta2 must be in [0, 1), got {t.beta2}")
    need(t.eps > 0, f"train.eps must be > 0, got {t.eps}")
    need(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    need(t.max_grad_norm >= 0, f"train.max_grad_norm must be >= 0 (0 = off), got {t.max_grad_norm}")
    pieces = 2 * p.cp if p.cp_layout == "zigzag" else p.cp
    need(
        p.cp < 1 or d.seq_len % pieces == 0,
        f"data.seq_len ({d.seq_len}) must be divisible by {pieces} to split it over "
        f"parallel.cp={p.cp} ranks ({p.cp_layout} layout); change data.seq_len or parallel.cp",
    )
    rate = cfg.moe.bias_update_rate
    need(rate >= 0, f"moe.bias_update_rate must be >= 0 (0 freezes the bias), got {rate}")
    cf = cfg.moe.capacity_factor
    need(cf is None or cf > 0, f"moe.capacity_factor must be > 0 or none (drop-less), got {cf}")
    need(
        cfg.metrics.expert_load_interval >= 0,
        f"metrics.expert_load_interval must be >= 0, got {cfg.metrics.expert_load_interval}",
    )
    need(
        t.micro_batch_size < 1 or t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
        f"train.micro_batch_size ({t.micro_batch_size})",
    )
    need(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    need(
        d.max_tokens is None or d.max_tokens > 0, f"data.max_tokens must be > 0, got {d.max_tokens}"
    )
    need(
        d.source not in _NEEDS_PATH or bool(d.path),
        f"data.path is required when data.source = '{d.source}' (set it to "
        f"{_NEEDS_PATH.get(d.source)})",
    )
    need(
        p.dp_shard == -1 or p.dp_shard >= 1,
        f"parallel.dp_shard must be -1 (all remaining ranks) or >= 1, got {p.dp_shard}",
    )
    need(c.interval >= 0, f"checkpoint.interval must be >= 0 (0 = off), got {c.interval}")
    need(c.keep_last >= 0, f"checkpoint.keep_last must be >= 0 (0 = keep all), got {c.keep_last}")
    if hasattr(cfg.model.args, "validate"):
        problems += cfg.model.args.validate()
    if problems:
        raise ConfigError(_join(problems))


# --- Help text and the resolved config as plain data ------------------------------------


def format_help() -> str:
    """Usage, then every key with its default, type and doc, the model keys of each model."""
    groups = []
    for section, cls in _SECTIONS.items():
        groups.append((f"[{section}]", section, cls))
        if cls is ModelSection:  # each registered model's own keys right below [model]
            models = [(n, get_model_spec(n).args_cls) for n in model_names()]
            groups += [(f"[model] keys of {n}", "model", args_cls) for n, args_cls in models]
    rows: list[tuple[str, str, str] | str] = []
    for title, section, cls in groups:
        rows += ["", title]
        for f in fields(cls):
            if cls is ModelSection and f.name == "args":
                continue  # filled from the model keys listed below
            default = f.default_factory() if f.default is MISSING else f.default
            doc = f.metadata.get("help", "")
            if "choices" in f.metadata:
                doc += f" [one of: {', '.join(f.metadata['choices'])}]"
            key = f"--{section}.{f.name}={_format_value(default)}"
            rows.append((key, _type_name(_hints(cls)[f.name]), doc))
    key_w = min(max(len(r[0]) for r in rows if isinstance(r, tuple)), 44)  # longer: own line
    type_w = max(len(r[1]) for r in rows if isinstance(r, tuple))
    lines = [
        (
            "usage: torchrun [--nproc_per_node=N] train.py --config FILE.toml"
            " [--section.key=value ...]"
        ),
        "",
        "Each key is read from the dataclass default, then the TOML file ([section] tables),",
        "then --section.key=value or --section.key value on the command line, the last winning.",
        "Booleans: true/false/yes/no/1/0. Lists: 1,2,3 or [1, 2, 3]. none clears an optional key.",
    ]
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        key = row[0]
        if len(key) > key_w:
            lines.append(f"  {key}")
            key = ""
        head = f"  {key:<{key_w}}  {row[1]:<{type_w}}  "
        lines.append(
            textwrap.fill(row[2], 100, initial_indent=head, subsequent_indent=" " * len(head))
        )
    return "\n".join(lines) + "\n"


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The resolved config as nested plain data, model args flattened into `model` as in TOML."""
    out = {f.name: asdict(getattr(cfg, f.name)) for f in fields(cfg)}
    del out["model"]["args"]
    if is_dataclass(cfg.model.args):
        out["model"].update(asdict(cfg.model.args))
    return out


# --- Small helpers ------------------------------------------------------------------------


@cache
def _hints(cls: type) -> dict[str, Any]:
    # Annotations are strings (`from __future__ import annotations`); resolve them once.
    return get_type_hints(cls)


def _all_args_classes() -> list[type]:
    return [get_model_spec(n).args_cls for n in model_names()]


def _dotted_keys(*args_classes: type) -> list[str]:
    """Every valid `section.key`, the [model] ones including those of the given args classes."""
    keys = [
        f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in fields(cls) if f.name != "args"
    ]
    for args_cls in args_classes:
        keys += [f"model.{f.name}" for f in fields(args_cls) if f"model.{f.name}" not in keys]
    return keys


def _unknown(dotted: str, origin: str, known: list[str]) -> str:
    if origin.startswith("--"):  # from the command line: answer in command-line syntax
        hint = _did_you_mean(dotted, known, "--{}") or "; see --help for the keys"
        return f"unknown option --{dotted}{hint}"
    return f"unknown key '{dotted}' in {origin}" + _did_you_mean(dotted, known, "'{}'")


def _did_you_mean(word: str, candidates: list[str], style: str) -> str:
    match = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {style.format(match[0])}?)" if match else ""


def _type_name(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _format_value(value: Any) -> str:
    """A value as written on the command line (how the help shows defaults)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else _format_value(value)


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)
