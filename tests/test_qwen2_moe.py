"""What only Qwen2-MoE has, beside the model suite (tests/test_models.py and its siblings,
which cover its parity with transformers, export, config.json, refusals and layouts from
tests/families/qwen2_moe.py): the sigmoid gate of its shared expert must change the
output, transformers-5's spelling of the published config, and Qwen2-57B-A14B's config."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.config import load_config
from moetrain.models.qwen2_moe import hf
from tests.families.models import hf_model, max_diff, ours_from_dir, token_ids
from tests.families.qwen2_moe import FAMILY, PUBLISHED

# Qwen/Qwen2-57B-A14B's config.json, which configs/qwen2_57b_a14b.toml restates.
QWEN2_57B = dict(
    PUBLISHED,
    hidden_size=3584,
    intermediate_size=18944,
    max_position_embeddings=131072,
    max_window_layers=28,
    num_attention_heads=28,
    num_hidden_layers=28,
    num_key_value_heads=4,
    sliding_window=131072,
    moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480,
    num_experts_per_tok=8,
    num_experts=64,
)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def test_the_shared_expert_gate_bites(transformers, tmp_path):
    """Parity means something for the gate only if the output depends on it."""
    case = "sparse_step2_gqa_bias"
    hf_model(transformers, FAMILY, case).save_pretrained(tmp_path)
    ours = ours_from_dir(FAMILY, tmp_path)
    ids = token_ids(FAMILY, (2, 17), 1)
    with torch.no_grad():
        gated = ours(ids).logits
        for i in FAMILY.moe_layers[case]:
            ours.layers[i].mlp.shared_expert_gate = None  # the shared expert, ungated
        ungated = ours(ids).logits
    assert max_diff(gated, ungated) > 1e-2


def test_transformers_spells_the_published_config_with_layer_types_and_qkv_bias(
    transformers, tmp_path
):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["layer_types"] == ["full_attention"] * 24 and v5["qkv_bias"] is True
    assert hf.load_hf_config(str(tmp_path / "v5")) == hf.load_hf_config(str(tmp_path))
    assert transformers.Qwen2MoeConfig().mlp_only_layers == []  # as an absent key reads


def test_the_57b_config_json_gives_the_shipped_config():
    toml = load_config(["--config=configs/qwen2_57b_a14b.toml"]).model.args
    assert toml == hf.args_from_hf_config(QWEN2_57B)
