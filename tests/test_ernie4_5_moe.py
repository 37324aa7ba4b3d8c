"""What only ERNIE-4.5 MoE has, beside the model suite (tests/test_models.py and its
siblings, which cover its parity with transformers (the pooled aux with a correction bias
on), export, config.json, refusals and layouts from tests/families/ernie4_5_moe.py): a tied
head that keeps its own bias, the routing bias's [1, E] key, transformers' in-memory names
and the released checkpoints' MTP keys, the end index transformers resolves, and the
aliases of its config.json."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.hf.weights import save_hf_checkpoint
from moetrain.models import HFFormatError
from moetrain.models.ernie4_5_moe import hf
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs
from moetrain.models.ernie4_5_moe.model import TiedHeadBias
from tests.families.ernie4_5_moe import FAMILY, PUBLISHED
from tests.families.models import (
    hf_model,
    native_args,
    native_model,
    ours_from_dir,
    spec_of,
    token_ids,
)

SPEC = spec_of(FAMILY)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@pytest.mark.parametrize("case", sorted(FAMILY.cases))
def test_a_tied_head_with_a_bias_keeps_only_the_bias(case):
    with torch.device("meta"):
        model = SPEC.build(native_args(FAMILY, case))
    args = model.args
    assert isinstance(model.lm_head, TiedHeadBias) == (args.tie_word_embeddings and args.use_bias)
    params = dict(model.named_parameters())
    assert ("lm_head.weight" in params) == (not args.tie_word_embeddings)
    assert ("lm_head.bias" in params) == args.use_bias


def test_the_routing_bias_is_exported_as_moe_statics(tmp_path):
    case = "start1_end3_shared2_bias_untied"
    args = native_args(FAMILY, case)
    ours = native_model(FAMILY, args).eval()
    save_hf_checkpoint(ours, SPEC.hf_adapter, args, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    layer = FAMILY.moe_layers[case][0]
    bias = saved[f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 8)
    assert torch.equal(bias[0], ours.layers[layer].mlp.gate.e_score_correction_bias)


def test_in_memory_names_read_and_mtp_keys_skipped(transformers, tmp_path):
    """transformers-5's in-memory names (stacked experts, the bias under `mlp.gate`) read as
    the saved ones do; the released checkpoints' MTP keys are skipped as transformers skips
    them, and any other unread key is still refused."""
    theirs = hf_model(transformers, FAMILY, "start1_end3_shared2_bias_untied")
    theirs.save_pretrained(tmp_path / "saved")
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    state = {k: v.clone().contiguous() for k, v in theirs.state_dict().items()}
    assert "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias" in state
    state["mtp_block.0.self_attn.q_proj.weight"] = torch.ones(4, 4)
    state["mtp_linear_proj.0.weight"] = torch.ones(4, 4)
    save_file(state, memory / "model.safetensors", metadata={"format": "pt"})
    ids = token_ids(FAMILY, (2, 11), 3)
    with torch.no_grad():
        want = ours_from_dir(FAMILY, tmp_path / "saved")(ids).logits
        assert torch.equal(ours_from_dir(FAMILY, memory)(ids).logits, want)
    state["model.layers.1.mlp.extra.weight"] = torch.ones(4, 4)
    save_file(state, memory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"model\.layers\.1\.mlp\.extra\.weight"):
        ours_from_dir(FAMILY, memory)


@pytest.mark.parametrize("case", ["interval2_noshared_tied", "all_moe_shared1_tied_bias_yarn"])
def test_transformers_writes_the_end_index_resolved(transformers, case, tmp_path):
    args = native_args(FAMILY, case)
    assert args.moe_layer_end_index == -1
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    back = hf.load_hf_config(str(tmp_path / "v5"))
    assert back.moe_layer_end_index == args.num_hidden_layers - 1
    assert [back.is_moe_layer(i) for i in range(4)] == [args.is_moe_layer(i) for i in range(4)]


def test_the_published_config_is_the_defaults_and_its_moe_layers():
    toml = hf.args_from_hf_config(PUBLISHED)
    assert dataclasses.replace(toml, moe_layer_end_index=-1) == Ernie45MoeArgs()
    sparse = hf.args_from_hf_config({"model_type": "ernie4_5_moe"})
    assert [sparse.is_moe_layer(i) for i in range(28)] == [False] + [True] * 27


def test_the_aliases_transformers_accepts_read_too():
    aliased = hf.args_from_hf_config({"num_experts": 16, "num_experts_per_tok": 4})
    assert (aliased.moe_num_experts, aliased.moe_k) == (16, 4)
