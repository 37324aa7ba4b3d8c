"""Native Qwen3-MoE against Hugging Face transformers (eager, fp32) on tiny random configs."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint  # noqa: E402
from moetrain.models import get_model_spec  # noqa: E402
from moetrain.models.common.balance_losses import load_balancing_loss  # noqa: E402
from moetrain.models.common.moe import MoEOptions  # noqa: E402
from moetrain.models.qwen3_moe.hf import HFFormatError, args_from_hf_config, load_hf_config  # noqa: E402

SPEC = get_model_spec("qwen3_moe")

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,  # not hidden/heads: the explicit head_dim must be honoured
    num_experts=8,
    num_experts_per_tok=2,
    rope_theta=10000.0,
    router_aux_loss_coef=0.01,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
CASES = {
    "topk_norm": dict(norm_topk_prob=True),
    "no_topk_norm_tied": dict(norm_topk_prob=False, tie_word_embeddings=True),
    "sparse_step_2": dict(norm_topk_prob=True, decoder_sparse_step=2),
    "mlp_only_layers": dict(norm_topk_prob=False, mlp_only_layers=[0, 2]),
    # YaRN, as a context extension sets it (Qwen3's published recipe: factor and the
    # original length), and with every option transformers reads.
    "yarn": dict(
        norm_topk_prob=True,
        max_position_embeddings=64,
        rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
    "yarn_all_options": dict(
        norm_topk_prob=True,
        rope=dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=8,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.5,
            truncate=False,
        ),
    ),
}


def _hf_model(overrides: dict, seed: int = 0):
    kwargs = dict(BASE, **overrides)
    rope = {
        "rope_type": "default",
        **kwargs.pop("rope", {}),
        "rope_theta": kwargs.pop("rope_theta"),
    }
    cfg = transformers.Qwen3MoeConfig(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _ours_from_dir(model_dir: str):
    args = load_hf_config(model_dir)
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, model_dir)
    return model.eval()


def _our_loss(model, input_ids, labels):
    out = model(input_ids)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    aux = load_balancing_loss(out.router_stats, model.args.num_experts, pooled=True)
    return out.logits, aux, ce + model.args.router_aux_loss_coef * aux


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_transformers(case, tmp_path):
    hf_model = _hf_model(CASES[case])
    hf_model.save_pretrained(tmp_path / "hf")
    ours = _ours_from_dir(str(tmp_path / "hf"))

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, BASE["vocab_size"], (2, 17), generator=g)
    labels = torch.randint(0, BASE["vocab_size"], (2, 17), generator=g)
    # HF shifts the labels inside its loss; ours are aligned with positions already.
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        hf_out = hf_model(input_ids, labels=labels, output_router_logits=True)
        logits, aux, our_loss = _our_loss(ours, input_ids, shifted)

    torch.testing.assert_close(logits, hf_out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux, hf_out.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_loss, hf_out.loss, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["topk_norm", "no_topk_norm_tied", "yarn_all_options"])
def test_export_round_trip_reproduces_transformers(case, tmp_path):
    hf_model = _hf_model(CASES[case])
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = _ours_from_dir(str(tmp_path / "hf"))
    save_hf_checkpoint(ours, SPEC.hf_adapter, ours.args, str(tmp_path / "export"))

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    input_ids = torch.randint(
        0, BASE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids).logits, hf_model(input_ids).logits, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            ours(input_ids).logits, hf_model(input_ids).logits, rtol=1e-4, atol=1e-4
        )


def test_both_config_dialects_give_the_same_args(tmp_path):
    hf_model = _hf_model(CASES["topk_norm"])
    hf_model.save_pretrained(tmp_path)
    v5 = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in v5
    published = {k: v for k, v in v5.items() if k != "rope_parameters"}
    published["rope_theta"] = v5["rope_parameters"]["rope_theta"]
    assert (
        args_from_hf_config(published) == args_from_hf_config(v5) == load_hf_config(str(tmp_path))
    )
    assert load_hf_config(str(tmp_path)).head_dim == 12


def test_refuses_other_model_types_and_mismatched_weights(tmp_path):
    with pytest.raises(HFFormatError, match="model_type"):
        args_from_hf_config({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2})
    linear = {"hidden_size": 8, "num_attention_heads": 2, "rope_scaling": {"type": "linear"}}
    with pytest.raises(HFFormatError, match="rope_scaling has RoPE type 'linear'.*remove"):
        args_from_hf_config(linear)
    hf_model = _hf_model(CASES["topk_norm"])
    hf_model.save_pretrained(tmp_path)
    args = load_hf_config(str(tmp_path))
    args.moe_intermediate_size = 8  # the weights were saved with 16
    with pytest.raises(ValueError, match="shape"):
        load_hf_weights(SPEC.build(args), SPEC.hf_adapter, args, str(tmp_path))
