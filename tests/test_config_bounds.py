"""Config bounds and refusals that span sections: one generic bound check for the job
sections and every model's args (`moetrain.models.common.args.arg`), every problem of a TOML at
once, and did-you-mean on the key's own name. Parsing and single refusals: test_config.py."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pytest

from moetrain.config import DataSection, TrainSection, format_help, load_config
from moetrain.models import get_model_spec, model_names
from moetrain.models.common.args import arg, field_problems
from moetrain.models.deepseek_v3.args import DeepseekV3Args
from moetrain.models.qwen3_moe.args import Qwen3MoeArgs
from tests.test_config import config_error, write_toml

# --- field bounds: one generic check for the job sections and the model args ------------


@dataclass
class _Bounded:
    sizes: list[int] = arg([1, 2], "each >= 1", ge=1)
    limit: float | None = arg(None, "optional, > 0 when set", gt=0, note="none = no limit")
    mode: str = arg("a", "a or b", choices=("a", "b"))


def test_field_problems_checks_each_list_element_and_skips_none():
    assert field_problems(_Bounded(), "toy") == []  # limit = None is not checked
    assert field_problems(_Bounded(sizes=[1, 0], limit=0.0, mode="c"), "toy") == [
        "toy.sizes must be >= 1, got [1, 0]",
        "toy.limit must be > 0 (none = no limit), got 0.0",
        "toy.mode must be one of a, b, got 'c'",
    ]


def test_bounds_of_job_sections_and_model_args():
    assert field_problems(replace(TrainSection(), beta1=1.0), "train") == [
        "train.beta1 must be in [0, 1), got 1.0"
    ]
    assert field_problems(DataSection(), "data") == []  # max_tokens = None: not checked
    assert field_problems(DeepseekV3Args(q_lora_rank=-1), "model") == [
        "model.q_lora_rank must be >= 0, got -1"
    ]
    # validate() is left with the cross-field checks: a bound is reported once, not twice
    assert Qwen3MoeArgs(hidden_size=0).validate() == []
    assert "checkpoint.interval must be >= 0 (0 = off), got -1" in config_error(
        ["--checkpoint.interval=-1"]
    )
    assert config_error(["--model.hidden_size=0"]) == "model.hidden_size must be > 0, got 0"


def test_deepseek_args_bounds_and_choices_from_the_command_line():
    load_config(["--model.name=deepseek_v3"])  # its defaults pass
    message = config_error(
        ["--model.name=deepseek_v3", "--model.kv_lora_rank=0", "--model.n_routed_experts=-4"]
    )
    assert message.startswith("2 problems:")
    assert "model.kv_lora_rank must be > 0, got 0" in message
    assert "model.n_routed_experts must be >= 0, got -4" in message
    message = config_error(["--model.name=deepseek_v3", "--model.rope_type=ntk"])
    assert "model.rope_type" in message and "'default', 'yarn'" in message


def test_help_shows_bounds():
    text = " ".join(format_help().split())
    assert "optimizer steps to run [value >= 1]" in text
    assert "AdamW beta2 [value in [0, 1)]" in text
    assert "per-head value width [value > 0]" in text  # a model arg (DeepSeek-V3)


def test_the_registry_names_each_models_own_args_class():
    from moetrain.models import model_args_class

    for name in model_names():
        assert model_args_class(name) is get_model_spec(name).args_cls


def test_every_problem_of_a_toml_is_reported_at_once(tmp_path):
    text = '[model]\nhidden_sise = 64\n\n[train]\nsteps = "ten"\nlerning_rate = 0.1\n'
    text += "\n[data]\nseq_len = -5\n\n[parallel]\ncp_layout = 'zigzga'\n"
    path = write_toml(tmp_path, text)
    message = config_error(["--config", path])
    assert message.startswith("5 problems:"), message
    assert "train.steps: expected int, got 'ten'" in message
    assert "unknown key 'train.lerning_rate'" in message and "(did you mean 'train.lr'?)" in message
    assert "(did you mean 'model.hidden_size'?)" in message
    assert "data.seq_len must be >= 1, got -5" in message
    assert "parallel.cp_layout: 'zigzga' is not one of" in message
    # The same problems on the command line, the same answer.
    argv = ["--train.steps=ten", "--train.lerning_rate=0.1", "--data.seq_len=-5"]
    message = config_error(["--config=configs/debug_qwen3_moe.toml", *argv])
    assert message.startswith("3 problems:") and "did you mean --train.lr?" in message


@pytest.mark.parametrize(
    "typed,meant",
    [
        ("train.lerning_rate", "train.lr"),  # the initials of its words
        ("train.learning_rate", "train.lr"),
        ("train.stpes", "train.steps"),  # a swap is one edit
        ("train.warmup", "train.warmup_steps"),  # its first words
        ("trian.steps", "train.steps"),  # a misspelt section first
        ("steps", "train.steps"),  # the first section that has it
        ("data.seqlen", "data.seq_len"),
        ("train.xyzzy", None),  # nothing close: no guess
    ],
)
def test_did_you_mean_ranks_by_the_keys_own_name(typed, meant):
    from moetrain.config.load import _all_args_classes, _dotted_keys
    from moetrain.config.suggest import closest_key

    assert closest_key(typed, _dotted_keys(*_all_args_classes())) == meant


@pytest.mark.parametrize(
    "name", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "ernie4_5_moe"]
)
def test_yarn_keys_are_bounded_for_every_model_that_has_them(name):
    """issue 52, items 11 and 16: a factor of 0 gave NaN at every step, an original length of
    0 a `math domain error` in the first forward; both are refused before launch."""
    assert "rope_factor" in {f.name for f in fields(get_model_spec(name).args_cls)}
    argv = [f"--model.name={name}", "--model.rope_type=yarn"]
    for value in ("0", "-2", "0.5"):
        assert config_error([*argv, f"--model.rope_factor={value}"]).startswith(
            "model.rope_factor must be >= 1 (the context extension: 1 = none"
        )
    message = config_error([*argv, "--model.rope_original_max_position_embeddings=0"])
    assert message.startswith("model.rope_original_max_position_embeddings must be > 0")
    assert "model.rope_beta_slow must be > 0" in config_error([*argv, "--model.rope_beta_slow=0"])
    load_config([*argv, "--model.rope_factor=1"])  # no extension: accepted


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_yarn_key_under_default_rope_is_refused_as_ignored(name):
    """issue 64, item 11: `--model.rope_factor=4` with rope_type=default ran with plain RoPE
    and said nothing; every YaRN key set under default RoPE is refused, naming the fix."""
    argv = [f"--model.name={name}", "--model.rope_type=default"]
    message = config_error([*argv, "--model.rope_factor=4"])
    assert message.startswith(
        "model.rope_factor=4.0 has no effect with model.rope_type=default: it acts only with "
        "model.rope_type=yarn; set model.rope_type=yarn, or leave model.rope_factor at its default"
    )
    assert "model.rope_beta_fast=8.0 has no effect" in config_error(
        [*argv, "--model.rope_beta_fast=8"]
    )
    load_config(argv)  # YaRN's keys at their defaults: nothing ignored
    load_config([*argv[:1], "--model.rope_type=yarn", "--model.rope_factor=4"])


def test_models_without_yarn_take_no_rope_factor():
    """Mixtral and OLMoE have plain RoPE only (their readers refuse a scaled config.json)."""
    for name in ("mixtral", "olmoe"):
        keys = {f.name for f in fields(get_model_spec(name).args_cls)}
        assert not {k for k in keys if k.startswith("rope_") and k != "rope_theta"}
