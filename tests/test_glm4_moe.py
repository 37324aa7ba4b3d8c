"""What only GLM-4.5 has, beside the model suite (tests/test_models.py and its siblings,
which cover its parity with transformers, export, config.json, refusals and layouts from
tests/families/glm4_moe.py): partial rotary, the MTP layer's keys in a released checkpoint,
and GLM-4.5-Air's config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.config import load_config
from moetrain.models import HFFormatError
from moetrain.models.glm4_moe import hf
from tests.families.glm4_moe import FAMILY, PUBLISHED
from tests.families.models import hf_model, native_args, ours_from_dir, spec_of

# zai-org/GLM-4.5-Air's differences from GLM-4.5.
AIR = dict(
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    num_hidden_layers=46,
    use_qk_norm=False,
)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@pytest.mark.parametrize("case", sorted(FAMILY.cases))
def test_rope_turns_part_of_each_head(case):
    with torch.device("meta"):
        model = spec_of(FAMILY).build(native_args(FAMILY, case))
    assert model.rope_dim == int(16 * FAMILY.cases[case]["partial_rotary_factor"]) < 16


def test_mtp_layer_keys_are_skipped_but_not_other_extra_layers(transformers, tmp_path):
    hf_model(transformers, FAMILY, "partial_qknorm_groups").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)
    L = FAMILY.base["num_hidden_layers"]  # the MTP layer of a released checkpoint: layer L
    extra = {
        f"model.layers.{L}.{k}": torch.ones(4, 4)
        for k in (
            "eh_proj.weight",
            "enorm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
            "self_attn.q_proj.weight",
            "mlp.experts.0.gate_proj.weight",
        )
    }
    save_file({**weights, **extra}, path, metadata={"format": "pt"})
    ours_from_dir(FAMILY, tmp_path)  # loads: every extra key is redundant
    with pytest.raises(HFFormatError, match=rf"model\.layers\.{L}\."):
        ours_from_dir(FAMILY, tmp_path, num_nextn_predict_layers=0)  # not an MTP layer then
    del extra[f"model.layers.{L}.eh_proj.weight"]  # a decoder layer config.json left out
    save_file({**weights, **extra}, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=rf"model\.layers\.{L}\."):
        ours_from_dir(FAMILY, tmp_path)


def test_transformers_moves_partial_rotary_into_rope_parameters(transformers, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert hf.load_hf_config(str(tmp_path / "v5")) == hf.args_from_hf_config(PUBLISHED)


def test_the_air_config_json_gives_the_shipped_config():
    air = load_config(["--config", "configs/glm4_5_air.toml"]).model.args
    assert hf.args_from_hf_config(dict(PUBLISHED, **AIR)) == air
