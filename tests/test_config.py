"""Tests of moetrain.config: defaults < TOML < CLI, typing, refusals and the help text."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields, replace

import pytest

from moetrain.config import (
    ConfigError,
    DataSection,
    JobConfig,
    ModelSection,
    TrainSection,
    checks,
    config_to_dict,
    format_help,
    load_config,
    validate,
)
from moetrain.config.checks import ZBV_EXACT_FROM
from moetrain.models import get_model_spec, model_names
from moetrain.models.qwen3_moe.args import Qwen3MoeArgs

# A small model that passes Qwen3MoeArgs.validate(), written as a TOML [model] table.
SMALL_MODEL = """
[model]
name = "qwen3_moe"
hidden_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
num_experts = 8
num_experts_per_tok = 2
mlp_only_layers = [0, 3]
"""


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return str(info.value)


# --- what is accepted ---------------------------------------------------------------------


def test_defaults_without_argv():
    cfg = load_config([])
    default = JobConfig()
    for section in ("job", "data", "train", "parallel", "checkpoint", "metrics"):
        assert getattr(cfg, section) == getattr(default, section)
    assert cfg.model.name == "qwen3_moe" and cfg.model.init_from_hf is None
    assert cfg.model.args == Qwen3MoeArgs()


def test_toml_values_are_applied(tmp_path):
    path = write_toml(
        tmp_path,
        """
[job]
name = "tiny"
[data]
source = "jsonl"
path = "data/*.jsonl"
max_tokens = 5000
shuffle = false
[train]
steps = 20
lr = 1        # an int is fine for a float field
schedule = "wsd"
[parallel]
dp_shard = 2
"""
        + SMALL_MODEL,
    )
    cfg = load_config(["--config", path])
    assert cfg.job.name == "tiny"
    assert (cfg.data.source, cfg.data.path, cfg.data.max_tokens) == ("jsonl", "data/*.jsonl", 5000)
    assert cfg.data.shuffle is False
    assert cfg.train.steps == 20 and cfg.train.schedule == "wsd"
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.parallel.dp_shard == 2
    assert cfg.train.seed == TrainSection().seed  # untouched keys keep their defaults
    args = cfg.model.args
    assert isinstance(args, Qwen3MoeArgs)
    assert (args.hidden_size, args.num_experts, args.mlp_only_layers) == (64, 8, [0, 3])
    assert args.vocab_size == Qwen3MoeArgs().vocab_size


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    path = write_toml(tmp_path, "[train]\nsteps = 50\nlr = 0.01\nwarmup_steps = 5\n")
    cfg = load_config(["--config", path, "--train.steps=7", "--train.warmup_steps", "2"])
    assert cfg.train.steps == 7  # CLI `--a.b=v` beats TOML
    assert cfg.train.warmup_steps == 2  # CLI `--a.b v` beats TOML
    assert cfg.train.lr == 0.01  # TOML beats the default
    assert cfg.train.beta1 == TrainSection().beta1  # default
    # --config may come anywhere, also as --config=FILE
    cfg = load_config(["--train.steps", "9", f"--config={path}"])
    assert (cfg.train.steps, cfg.train.lr) == (9, 0.01)


def test_model_args_from_toml_and_cli(tmp_path):
    path = write_toml(tmp_path, SMALL_MODEL)
    cfg = load_config(["--config", path, "--model.hidden_size=128", "--model.mlp_only_layers=1,2"])
    assert cfg.model.args.hidden_size == 128
    assert cfg.model.args.head_dim == 16  # from TOML
    assert cfg.model.args.mlp_only_layers == [1, 2]
    cfg = load_config(["--config", path, "--model.mlp_only_layers", "[2, 3]"])
    assert cfg.model.args.mlp_only_layers == [2, 3]
    cfg = load_config(["--config", path, "--model.mlp_only_layers=[]"])
    assert cfg.model.args.mlp_only_layers == []
    cfg = load_config(["--config", path, "--model.init_from_hf=/models/qwen"])
    assert cfg.model.init_from_hf == "/models/qwen"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("FALSE", False), ("1", True), ("0", False), ("yes", True), ("No", False)],
)
def test_cli_bool(text, expected):
    assert load_config([f"--data.shuffle={text}"]).data.shuffle is expected


@pytest.mark.parametrize(("text", "expected"), [("1e-4", 1e-4), ("0.002", 0.002), ("3", 3.0)])
def test_cli_float(text, expected):
    lr = load_config(["--train.lr", text]).train.lr
    assert lr == expected and isinstance(lr, float)


def test_cli_optional(tmp_path):
    path = write_toml(tmp_path, '[data]\nmax_tokens = 100\neos_token = "</s>"\n')
    cfg = load_config(["--config", path, "--data.max_tokens=none", "--data.eos_token=NULL"])
    assert cfg.data.max_tokens is None and cfg.data.eos_token is None
    assert load_config(["--data.max_tokens=64"]).data.max_tokens == 64
    # a plain `str` field keeps "none" as text (checkpoint.resume = none means "do not resume")
    assert load_config(["--checkpoint.resume=none"]).checkpoint.resume == "none"


def test_negative_value_after_option():
    assert load_config(["--parallel.dp_shard", "-1"]).parallel.dp_shard == -1


def test_config_to_dict_is_plain_and_flat(tmp_path):
    cfg = load_config(
        ["--config", write_toml(tmp_path, SMALL_MODEL), "--train.steps=3", "--train.warmup_steps=1"]
    )
    d = config_to_dict(cfg)
    assert json.loads(json.dumps(d)) == d  # plain data, loggable as JSON
    assert set(d) == {f.name for f in fields(JobConfig)}
    assert d["train"]["steps"] == 3
    assert d["model"]["name"] == "qwen3_moe" and "args" not in d["model"]
    assert d["model"]["hidden_size"] == 64 and d["model"]["mlp_only_layers"] == [0, 3]


def _cli_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):  # strings quoted: a TOML array, as the command line reads it
        return "[" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in value) + "]"
    return str(value)


def test_help_lists_every_key_with_its_default():
    text = format_help()
    assert text.startswith("usage: torchrun [--nproc_per_node=N] train.py --config FILE.toml")
    groups = [(f.name, f.default_factory) for f in fields(JobConfig)]
    groups += [("model", get_model_spec(n).args_cls) for n in model_names()]
    for section, cls in groups:
        assert f"[{section}]" in text
        for f in fields(cls):
            if cls is ModelSection and f.name == "args":
                continue
            default = f.default_factory() if f.default is MISSING else f.default
            key = re.escape(f"--{section}.{f.name}={_cli_text(default)}")
            assert re.search(key + r"(\s|$)", text, re.M), key
    for name in model_names():
        assert f"[model] keys of {name}" in text
    assert "[one of: stdlib, text, jsonl, hf_datasets, tokens]" in " ".join(text.split())  # choices


# --- what is refused ----------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    assert missing in config_error(["--config", missing])


def test_toml_syntax_error(tmp_path):
    path = write_toml(tmp_path, "[train]\nsteps = = 3\n")
    message = config_error(["--config", path])
    assert path in message and "invalid TOML" in message and "line 2" in message


def test_unknown_section(tmp_path):
    message = config_error(["--config", write_toml(tmp_path, "[trian]\nsteps = 3\n")])
    assert "unknown section [trian]" in message and "did you mean [train]?" in message


def test_key_outside_any_section(tmp_path):
    message = config_error(["--config", write_toml(tmp_path, "steps = 3\n")])
    assert "'steps'" in message and "did you mean 'train.steps'?" in message


def test_unknown_key_in_toml(tmp_path):
    path = write_toml(tmp_path, "[train]\nstpes = 3\n")
    message = config_error(["--config", path])
    assert f"unknown key 'train.stpes' in {path} (did you mean 'train.steps'?)" == message


def test_unknown_key_on_cli():
    assert config_error(["--train.stpes=3"]) == (
        "unknown option --train.stpes (did you mean --train.steps?)"
    )
    assert "did you mean --train.steps?" in config_error(["--trian.steps=3"])
    assert "did you mean --train.steps?" in config_error(["--steps=3"])


def test_unknown_model_key(tmp_path):
    path = write_toml(tmp_path, "[model]\nhiden_size = 64\n")
    assert "did you mean 'model.hidden_size'?" in config_error(["--config", path])
    assert "did you mean --model.init_from_hf?" in config_error(["--model.init_from_fh=x"])
    assert "model.args" in config_error(["--model.args=1"])  # not a settable key


def test_unknown_model_name(tmp_path):
    path = write_toml(tmp_path, '[model]\nname = "llama9"\n')
    message = config_error(["--config", path])
    assert "model.name" in message and "'llama9'" in message
    assert all(name in message for name in model_names())


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[train]\nsteps = "5"\n', "train.steps: expected int, got '5'"),
        ("[train]\nsteps = 5.0\n", "train.steps: expected int, got 5.0"),
        ("[train]\nsteps = true\n", "train.steps: expected int, got true"),
        ('[train]\nlr = "1e-3"\n', "train.lr: expected float, got '1e-3'"),
        ("[data]\nshuffle = 1\n", "data.shuffle: expected bool, got 1"),
        ("[job]\nname = 3\n", "job.name: expected str, got 3"),
        ("[model]\nmlp_only_layers = [1, 1.5]\n", "model.mlp_only_layers: expected list[int]"),
        ("[model]\nmlp_only_layers = 2\n", "model.mlp_only_layers: expected list[int], got 2"),
        ("[train]\nlr = inf\n", "train.lr: expected float, got inf"),
    ],
)
def test_wrong_type_from_toml(tmp_path, toml, expected):
    path = write_toml(tmp_path, toml)
    message = config_error(["--config", path])
    assert expected in message and f"(from {path})" in message


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--train.steps=abc", "train.steps: expected int, got 'abc' (from --train.steps)"),
        ("--train.steps=1.5", "train.steps: expected int, got '1.5'"),
        ("--train.lr=fast", "train.lr: expected float, got 'fast'"),
        ("--data.shuffle=maybe", "data.shuffle: expected bool, got 'maybe'"),
        ("--data.max_tokens=lots", "data.max_tokens: expected int | None, got 'lots'"),
        ("--model.mlp_only_layers=1,x", "model.mlp_only_layers: expected list[int], got '1,x'"),
        ("--model.mlp_only_layers=[1,", "model.mlp_only_layers: expected list[int]"),
        ("--train.steps=none", "train.steps: expected int, got 'none'"),
    ],
)
def test_wrong_type_from_cli(arg, expected):
    assert expected in config_error([arg])


def test_a_list_of_words_in_brackets_is_read_and_a_bad_list_shows_the_forms(tmp_path):
    # What bash leaves of --peft.targets=["attention", "experts"] unquoted: bare words.
    for text in ("[attention, experts]", '["attention", "experts"]', "attention,experts"):
        assert load_config([f"--peft.targets={text}"]).peft.targets == ["attention", "experts"]
    message = config_error(["--peft.targets=[attention,]"])
    assert message == (
        "peft.targets: expected list[str], got '[attention,]' (from --peft.targets); write a "
        "list as --peft.targets=attention,experts, or "
        """--peft.targets='["attention", "experts"]' (quoted for the shell)"""
    )
    path = write_toml(tmp_path, '[peft]\ntargets = "attention"\n')
    assert 'write a list as targets = ["attention", "experts"]' in config_error(["--config", path])


def test_bad_choice():
    message = config_error(["--train.schedule=linear"])
    assert "train.schedule" in message and "'linear'" in message
    assert "'cosine', 'wsd', 'constant'" in message and "(from --train.schedule)" in message


def test_stray_argument_and_missing_value():
    assert "unexpected argument 'train.steps=3'" in config_error(["train.steps=3"])
    assert "--train.steps needs a value" in config_error(["--train.steps"])
    assert "--config needs a value" in config_error(["--config", "--train.steps=3"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--train.steps=0", "--train.warmup_steps=0"], "train.steps must be >= 1, got 0"),
        (["--train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
        (["--train.global_batch_size=0"], "train.global_batch_size must be >= 1"),
        (["--train.micro_batch_size=0"], "train.micro_batch_size must be >= 1"),
        (
            ["--train.global_batch_size=10", "--train.micro_batch_size=4"],
            "train.global_batch_size (10) must be a multiple of train.micro_batch_size (4)",
        ),
        (["--train.lr=0"], "train.lr must be > 0"),
        (["--train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1]"),
        (["--train.decay_ratio=-0.1"], "train.decay_ratio must be in [0, 1]"),
        (["--train.beta2=1"], "train.beta2 must be in [0, 1)"),
        (["--train.max_grad_norm=-1"], "train.max_grad_norm must be >= 0"),
        (["--data.seq_len=0"], "data.seq_len must be >= 1"),
        (["--data.num_workers=-1"], "data.num_workers must be >= 0"),
        (["--data.max_tokens=0"], "data.max_tokens must be > 0"),
        (["--data.source=text"], "data.path is required when data.source = 'text'"),
        (["--data.source=hf_datasets"], "data.path is required when data.source = 'hf_datasets'"),
        (["--metrics.log_interval=0"], "metrics.log_interval must be >= 1"),
        (["--parallel.dp_replicate=0"], "parallel.dp_replicate must be >= 1"),
        (["--parallel.dp_shard=0"], "parallel.dp_shard must be -1"),
        (["--checkpoint.interval=-1"], "checkpoint.interval must be >= 0"),
        (["--checkpoint.keep_last=-2"], "checkpoint.keep_last must be >= 0"),
        (
            ["--model.num_key_value_heads=5"],
            "model.num_attention_heads (32) must be a multiple of model.num_key_value_heads (5)",
        ),
        (["--model.mlp_only_layers=48"], "model.mlp_only_layers has indices outside"),
        (
            ["--parallel.cp_layout=balanced", "--data.document_mask=false"],
            "parallel.cp_layout=balanced lays each micro-batch out by its documents' work",
        ),
        (
            ["--parallel.cp_layout=balanced", "--parallel.cp=3", "--data.seq_len=36"],
            "data.seq_len (36) must be divisible by 24",
        ),
        (
            [
                "--parallel.pp=2",
                "--parallel.pp_schedule=DualPipeV",
                "--parallel.ep=2",
                "--parallel.cp=2",
            ],
            "ring attention's transfers (parallel.cp > 1) would run on both at once",
        ),  # fmt: skip
        (
            ["--train.activation_checkpoint=selective", "--peft.method=lora", "--peft.dropout=0.1"],
            "peft.dropout=0.1 with train.activation_checkpoint=selective",
        ),
        (
            ["--parallel.ep_overlap=chunks"],
            "parallel.ep_overlap=chunks splits each MoE layer's tokens to overlap the expert "
            "all-to-all, and parallel.ep=1 has none",
        ),
    ],
)
def test_impossible_values(argv, expected):
    assert expected in config_error(argv)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu130"])
def test_zbv_is_refused_on_a_torch_whose_zbv_was_not_exact(version, monkeypatch):
    """torch 2.11's ZBVZeroBubble disagreed with one rank (the embedding's gradient, with EP
    or DeepSeek-V3's MTP): refused there, naming the versions and DualPipeV; accepted from
    2.13."""
    argv = ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble"]
    if checks.torch_release() >= ZBV_EXACT_FROM:
        load_config(argv)
    monkeypatch.setattr(checks, "installed_torch", lambda: version)
    err = config_error(argv)
    assert f"ZBVZeroBubble does not train as one rank does on torch {version}" in err
    assert "exact from torch 2.13" in err and "pp_schedule=DualPipeV" in err


def test_all_problems_are_reported_together(tmp_path):
    path = write_toml(tmp_path, "[train]\nstpes = 3\nlr = 'x'\n[data]\nsource = 'csv'\n")
    message = config_error(["--config", path, "--parallel.dp_shard=two", "oops"])
    assert message.startswith("5 problems:")
    for part in ("train.stpes", "train.lr", "data.source", "parallel.dp_shard", "'oops'"):
        assert part in message
    message = config_error(
        ["--train.steps=0", "--data.source=text", "--model.num_key_value_heads=3"]
    )
    # (warmup 10 > steps is not a problem: the warmup is clamped to the run)
    assert message.startswith("3 problems:")
    assert len(message.splitlines()) == 4
    for part in ("train.steps must", "data.path", "num_key_value_heads"):
        assert part in message


def test_validate_accepts_defaults_and_checks_a_built_config():
    cfg = load_config([])
    validate(cfg)  # no exception
    bad = replace(cfg, data=replace(DataSection(), source="jsonl"))
    with pytest.raises(ConfigError, match="data.path is required"):
        validate(bad)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "balanced"])
def test_without_context_parallel_ranks_any_sequence_length_is_accepted(layout):
    """issue 52, item 15: cp=1 cuts nothing, yet seq_len=63 was refused as "must be divisible
    by 2 to split it over parallel.cp=1 ranks"."""
    cfg = load_config(["--data.seq_len=63", f"--parallel.cp_layout={layout}"])
    assert cfg.data.seq_len == 63
    pieces = {"zigzag": 4, "contiguous": 2, "balanced": 16}[layout]
    assert f"must be divisible by {pieces} to split it over parallel.cp=2" in config_error(
        ["--data.seq_len=63", f"--parallel.cp_layout={layout}", "--parallel.cp=2"]
    )
