"""What only OLMoE has, beside the model suite (tests/test_models.py and its siblings, which
cover its parity with transformers, export, config.json, refusals and layouts from
tests/families/olmoe.py): clip_qkv must change the output, and a head_dim written into
config.json only as hidden_size / heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.hf.weights import save_hf_checkpoint
from moetrain.models import HFFormatError
from moetrain.models.olmoe import hf
from moetrain.models.olmoe.args import OlmoeArgs
from tests.families.family import native_kwargs
from tests.families.models import (
    hf_model,
    max_diff,
    native_model,
    ours_from_dir,
    spec_of,
    token_ids,
)
from tests.families.olmoe import FAMILY

SPEC = spec_of(FAMILY)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@pytest.mark.parametrize("case", ["gqa_clip_bias", "mqa_clip_tied_topk_norm"])
def test_clip_qkv_actually_clamps(transformers, case, tmp_path):
    """The parity with transformers means something for clip_qkv only if the clamp changes
    the output."""
    hf_model(transformers, FAMILY, case).save_pretrained(tmp_path)
    clipped = ours_from_dir(FAMILY, tmp_path)
    assert clipped.args.clip_qkv == FAMILY.cases[case]["clip_qkv"]
    unclipped = SPEC.build(dataclasses.replace(clipped.args, clip_qkv=None)).eval()
    unclipped.load_state_dict(clipped.state_dict())
    ids = token_ids(FAMILY, (2, 17), 1)
    with torch.no_grad():
        assert max_diff(clipped(ids).logits, unclipped(ids).logits) > 1e-2


def test_an_explicit_head_dim_exports_and_reloads_in_transformers(transformers, tmp_path):
    """head_dim = hidden / heads, written into config.json, which transformers reads."""
    args = OlmoeArgs(**native_kwargs(FAMILY, dict(FAMILY.cases["gqa_clip_bias"], head_dim=8)))
    ours = native_model(FAMILY, args).eval()
    save_hf_checkpoint(ours, SPEC.hf_adapter, args, str(tmp_path))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = token_ids(FAMILY, (2, 13), 2)
    with torch.no_grad():
        assert max_diff(reloaded.eval()(ids).logits, ours(ids).logits) < 1e-4
    assert hf.load_hf_config(str(tmp_path)) == args


def test_a_head_dim_transformers_cannot_represent_is_refused():
    with pytest.raises(HFFormatError, match="unset model.head_dim"):
        hf.hf_config_dict(OlmoeArgs(**native_kwargs(FAMILY, dict(head_dim=12))))


def test_out_of_range_values_are_the_bounds_to_report():
    bad = OlmoeArgs(hidden_size=0, clip_qkv=-1.0, router_aux_loss_coef=-0.1)
    assert bad.validate() == []
