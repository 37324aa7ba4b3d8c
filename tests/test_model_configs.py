"""The model suite's config half (tests/test_models.py has the weights): every registered
model's config.json reader and writer, refusals, bounds, FLOPs and plan, from its table in
tests/families/. One test per (family, item), so that a failure names both and hides no
other."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from moetrain.models import HFFormatError
from moetrain.models.common.args import field_problems
from moetrain.models.common.moe import MoE
from tests.families import FAMILIES
from tests.families.family import Family, native_kwargs
from tests.families.models import (
    hf_config,
    native_args,
    our_moe_layers,
    published_dialect,
    spec_of,
)

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

EACH_FAMILY = [pytest.param(family, id=name) for name, family in FAMILIES.items()]
EACH_CASE = [
    pytest.param(family, case, id=f"{name}-{case}")
    for name, family in FAMILIES.items()
    for case in family.cases
]


def _hf(family: Family):
    """The family's adapter module (its hf.py)."""
    return spec_of(family).hf_adapter


def _published_args(family: Family) -> Any:
    return family.published_args() if family.published_args else spec_of(family).args_cls()


def _round_trip_args(family: Family, which: str) -> Any:
    if which == "defaults":
        return spec_of(family).args_cls()
    if which == "published":
        return _published_args(family)
    if which in family.cases:
        return native_args(family, which)
    return spec_of(family).args_cls(**native_kwargs(family, family.config_round_trips[which]))


ROUND_TRIPS = [
    pytest.param(family, which, id=f"{name}-{which}")
    for name, family in FAMILIES.items()
    for which in (
        "defaults",
        *(["published"] if family.published_args else []),
        *family.cases,
        *family.config_round_trips,
    )
]


def _without_resolved(family: Family, read: Any, written: Any) -> Any:
    """`read` with the keys a writer may resolve set back as `written` has them, once they
    are checked to hold either that or the resolved value."""
    for key, resolve in family.resolved_on_save.items():
        assert getattr(read, key) in (getattr(written, key), resolve(written)), key
    return dataclasses.replace(read, **{k: getattr(written, k) for k in family.resolved_on_save})


@pytest.mark.parametrize("family, which", ROUND_TRIPS)
def test_config_json_round_trip(family: Family, which: str, tmp_path):
    """Ours reads back what it writes, and so after transformers rewrote it in its dialect."""
    args = _round_trip_args(family, which)
    hf = _hf(family)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    assert _without_resolved(family, hf.load_hf_config(str(tmp_path)), args) == args
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    assert _without_resolved(family, hf.load_hf_config(str(tmp_path / "v5")), args) == args


@pytest.mark.parametrize("family, case", EACH_CASE)
def test_both_config_dialects_give_the_same_args(family: Family, case: str, tmp_path):
    hf_config(transformers, family, family.cases[case]).save_pretrained(tmp_path)
    v5 = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in v5
    hf = _hf(family)
    args = hf.load_hf_config(str(tmp_path))
    assert hf.args_from_hf_config(published_dialect(family, v5)) == hf.args_from_hf_config(v5)
    assert hf.args_from_hf_config(v5) == args


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_the_published_config_json_reads_as_the_published_model(family: Family, tmp_path):
    """In its own dialect and in transformers-5's, which rewrites it: rope_parameters instead
    of rope_theta (a non-default theta shows which one is read)."""
    hf, want = _hf(family), _published_args(family)
    assert hf.args_from_hf_config(family.published) == want
    (tmp_path / "config.json").write_text(json.dumps(dict(family.published, rope_theta=50000.0)))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"]["rope_theta"] == 50000.0
    if not family.published.get("rope_scaling"):  # plain RoPE: nothing else
        moved = {k: family.published[k] for k in family.rope_parameter_keys}
        assert v5["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0, **moved}
    assert "rope_theta" not in v5 and "rope_scaling" not in v5
    want = dataclasses.replace(want, rope_theta=50000.0)
    assert hf.load_hf_config(str(tmp_path)) == hf.load_hf_config(str(tmp_path / "v5")) == want


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_keys_a_config_json_leaves_out_mean_transformers_defaults(family: Family):
    """Not ours (the published model's): what transformers builds from the same file."""
    minimal, expected = family.absent_keys
    minimal = minimal or {"model_type": family.name}
    hf = _hf(family)
    ours = hf.args_from_hf_config(minimal)
    config_class = getattr(transformers, family.hf_config_class)
    theirs = config_class(**{k: v for k, v in minimal.items() if k != "model_type"})
    for key in getattr(hf, "_SAME_NAME_KEYS", ()):
        if key not in family.resolved_on_save:  # transformers resolves them when it reads
            assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    for key, value in expected.items():
        assert getattr(ours, key) == value, key


REFUSALS = [
    pytest.param(family, which, id=f"{name}-{which}")
    for name, family in FAMILIES.items()
    for which in family.refusals
]


@pytest.mark.parametrize("family, which", REFUSALS)
def test_refusals_name_the_key_and_the_fix(family: Family, which: str):
    change, match = family.refusals[which]
    with pytest.raises(HFFormatError, match=match):
        _hf(family).args_from_hf_config(dict(family.published, **change))


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_the_defaults_and_the_published_model_are_within_bounds(family: Family):
    for args in (spec_of(family).args_cls(), _published_args(family)):
        assert field_problems(args, "model") == args.validate() == []


BOUNDS = [
    pytest.param(family, which, id=f"{name}-{which}")
    for name, family in FAMILIES.items()
    for which in family.bounds
]
CROSS_FIELD = [
    pytest.param(family, which, id=f"{name}-{which}")
    for name, family in FAMILIES.items()
    for which in family.cross_field
]


@pytest.mark.parametrize("family, which", BOUNDS)
def test_a_value_out_of_its_bounds_is_named(family: Family, which: str):
    overrides, expected = family.bounds[which]
    problems = field_problems(spec_of(family).args_cls(**overrides), "model")
    assert len(problems) == len(expected), problems
    for text in expected:
        assert any(text in problem for problem in problems), (text, problems)


@pytest.mark.parametrize("family, which", CROSS_FIELD)
def test_fields_that_disagree_are_named(family: Family, which: str):
    overrides, expected = family.cross_field[which]
    problems = spec_of(family).args_cls(**overrides).validate()
    assert len(problems) == len(expected), problems
    for text, problem in zip(expected, problems, strict=True):
        assert text in problem, problems


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_flops_loss_terms_and_plan_cover_the_model(family: Family):
    """Routed experts count top_k / num_experts of their size, everything else whole; the
    input embedding is a lookup (unless the head is tied to it); the attention as the table
    works it out."""
    args = native_args(family, family.flops.case)
    spec = spec_of(family)
    with torch.device("meta"):
        model = spec.build(args)
    names = {n for n, _ in model.named_modules()}
    assert {f"layers.{i}.self_attn.core" for i in range(args.num_hidden_layers)} <= names
    moe = our_moe_layers(model)
    assert moe and {f"layers.{i}.mlp.{part}" for i in moe for part in ("experts", "gate")} <= names
    layer = model.layers[moe[0]].mlp
    assert isinstance(layer, MoE)
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    others = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
    embedding = 0 if args.tie_word_embeddings else args.vocab_size * args.hidden_size
    active = others - embedding + routed * layer.top_k / layer.num_experts
    assert spec.flops_per_token(model, 64) == pytest.approx(6 * active + family.flops.attention)
    assert spec.loss_terms(args).aux_loss_coef == family.flops.aux_loss_coef
    assert spec.max_positions(args) == args.max_position_embeddings
