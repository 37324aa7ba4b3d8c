"""GPT-OSS added through the model contract: parity with transformers' GptOssForCausalLM
(eager, fp32, tiny random configs: windows shorter than the sequence, large sinks, GQA and
MQA, top-k > 1), packed documents against transformers run per document, HF export and
config round trips, MXFP4 refusals, and train.py on every layout."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoEOptions
from moetrain.models.gpt_oss import hf
from moetrain.models.gpt_oss.args import GptOssArgs
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("gpt_oss")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0}  # fmt: skip
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=8,
    num_local_experts=6,
    max_position_embeddings=256,
    router_aux_loss_coef=0.01,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
    swiglu_limit=1.5,  # low enough that the clamps bite at this init
)
CASES = {
    # a 5-token window on layers 0 and 2 of a 17-token sequence; sinks x20: some dominate
    "window_gqa_top2": dict(num_key_value_heads=2, num_experts_per_tok=2, sliding_window=5),
    # a window longer than the sequence (no effect), every head its own K/V, top-3
    "long_window_mha_top3": dict(num_key_value_heads=4, num_experts_per_tok=3, sliding_window=64),
    # MQA, layers in another order, a 3-token window
    "mqa_layer_types_top2": dict(
        num_key_value_heads=1,
        num_experts_per_tok=2,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),  # fmt: skip
}


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norms at 1 and biases at 0, under which a dropped bias or a norm over the
    wrong width would go unseen; the sinks are made large, so that they matter."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or "bias" in name:
            p.add_(0.5 * torch.randn(p.shape, generator=g))
        if name.endswith("sinks"):
            p.mul_(20.0)


def _hf_model(transformers, overrides: dict, seed: int = 0):
    cfg = transformers.GptOssConfig(**dict(BASE, **overrides), rope_parameters=dict(YARN))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    _perturb(model, seed + 1)
    return model


def _ours_from_dir(model_dir) -> torch.nn.Module:
    args = hf.load_hf_config(str(model_dir))
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, str(model_dir))
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_aux_loss_match_transformers(transformers, case, tmp_path):
    hf_model = _hf_model(transformers, CASES[case])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf_model(ids, labels=ids, output_router_logits=True)
        out = ours(ids)
    diff = (out.logits - theirs.logits).abs().max().item()
    print(f"\n{case}: max |logit diff| = {diff:.3g} (logits up to {out.logits.abs().max():.2f})")
    assert diff < 1e-4
    aux = load_balancing_loss(out.router_stats, ours.args.num_local_experts, pooled=True)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=1e-6)


def test_packed_documents_equal_transformers_run_per_document(transformers, tmp_path):
    hf_model = _hf_model(transformers, CASES["window_gqa_top2"])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    g = torch.Generator().manual_seed(2)
    lengths = [9, 4, 11]  # windows shorter and longer than a document
    docs = [torch.randint(0, BASE["vocab_size"], (n,), generator=g) for n in lengths]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, document_positions(document_ids), document_ids).logits[0]
        alone = torch.cat([hf_model(d[None]).logits[0] for d in docs])
    assert (out - alone).abs().max().item() < 1e-4


def test_export_reloads_in_transformers(transformers, tmp_path):
    args = GptOssArgs(**dict(BASE, **CASES["mqa_layer_types_top2"]), rope_factor=4.0,
                      rope_original_max_position_embeddings=32, rope_theta=10000.0)  # fmt: skip
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb(ours, seed=4)
    save_hf_checkpoint(ours.eval(), SPEC.hf_adapter, args, str(tmp_path))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.GptOssForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, BASE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (reloaded.eval()(ids).logits - ours(ids).logits).abs().max().item()
    assert diff < 1e-4
    assert _ours_from_dir(tmp_path).args == args  # and back


def test_published_configs_and_mxfp4_refusals(tmp_path):
    published = {  # openai/gpt-oss-20b's config.json, in its own dialect
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
        "vocab_size": 201088, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
        "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
        "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
        "truncate": False}, "swiglu_limit": 7.0, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "tie_word_embeddings": False, "router_aux_loss_coef": 0.9,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"],
                                "quant_method": "mxfp4"},
    }  # fmt: skip
    with pytest.raises(HFFormatError, match=r"quantization_config \(mxfp4\).*dequantise"):
        hf.args_from_hf_config(published)
    dequantised = {k: v for k, v in published.items() if k != "quantization_config"}
    args = hf.args_from_hf_config(dequantised)
    assert args == GptOssArgs(num_hidden_layers=24, num_local_experts=32, layer_types=args.layer_types,
                              router_aux_loss_coef=0.9)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args)))
    assert hf.load_hf_config(str(tmp_path)) == args
    with pytest.raises(HFFormatError, match=r"_blocks: the experts are MXFP4"):
        SPEC.hf_adapter.hf_keys(
            "layers.0.mlp.experts.down_proj", (32, 2880, 2880), args, lambda k: True
        )


@pytest.mark.slow
def test_train_py_losses_agree_on_every_layout(tmp_path, monkeypatch):
    """configs/debug_gpt_oss.toml (windows and sinks) on 1 rank, two pipeline stages, EP 2,
    CP 2, CP 2 x EP 2 (plain FSDP: every other layout shards within it)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    common = [
        "--config=configs/debug_gpt_oss.toml",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",  # longer than the 24-token window; 4 zigzag chunks of 16 at cp 2
        "--data.max_tokens=200000",
        "--metrics.log_interval=1",
    ]
    one = run_train(common, tmp_path / "one")
    layouts = {"pp2": ["--parallel.pp=2"], "ep2": ["--parallel.ep=2"], "cp2": ["--parallel.cp=2"],
               "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"]}  # fmt: skip
    for name, layout in layouts.items():
        run = run_train(common + layout, tmp_path / name, nproc=2)
        assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in one], rel=1e-5), name
        assert [r["grad_norm"] for r in run] == pytest.approx(
            [r["grad_norm"] for r in one], rel=1e-5
        ), name
