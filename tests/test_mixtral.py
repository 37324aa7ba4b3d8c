"""What only Mixtral has, beside the model suite (tests/test_models.py and its siblings,
which cover its parity with transformers, export, config.json, refusals and layouts from
tests/families/mixtral.py): its sliding window must change the output, a checkpoint of
stacked experts reads, and HF's alias for the expert count."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moetrain.hf.weights import load_hf_weights
from moetrain.models.common.moe import MoEOptions
from moetrain.models.mixtral import hf
from tests.families.mixtral import FAMILY
from tests.families.models import hf_model, native_args, ours_from_dir, spec_of, token_ids

SPEC = spec_of(FAMILY)


def test_the_sliding_window_changes_the_output(tmp_path):
    """The parity with transformers means something for the window only if it bites."""
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    hf_model(transformers, FAMILY, "window_gqa_top2").save_pretrained(tmp_path)
    windowed = ours_from_dir(FAMILY, tmp_path)
    assert windowed.args.sliding_window == 5
    full = SPEC.build(dataclasses.replace(windowed.args, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    ids = token_ids(FAMILY, (2, 17), 1)
    with torch.no_grad():
        assert (full(ids).logits - windowed(ids).logits).abs().max().item() > 1e-2


def test_a_checkpoint_of_stacked_experts_loads_too(tmp_path):
    """transformers-5's in-memory names (`mlp.gate`, `mlp.experts.gate_up_proj`: neither
    renamed to `block_sparse_moe` nor split per expert) are read as well."""
    from safetensors.torch import save_file

    args = native_args(FAMILY, "window_gqa_top2")
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    state = {
        n if n.startswith("lm_head.") else f"model.{n}": t for n, t in ours.state_dict().items()
    }
    assert "model.layers.0.mlp.gate.weight" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args)))
    loaded = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(loaded, SPEC.hf_adapter, args, str(tmp_path))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_expert_count_reads_under_transformers_alias():
    assert hf.args_from_hf_config({"num_experts": 4}).num_local_experts == 4
