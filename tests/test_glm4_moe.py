"""GLM-4.5 MoE added through the model contract: parity with transformers' Glm4MoeForCausalLM
(eager, fp32, tiny random configs: partial rotary, q/k norms, expert groups, randomised
correction biases, YaRN), packed documents against transformers run per document, HF
import/export and config.json round trips, the MTP layer's keys, refusals, and train.py on
every layout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.config import load_config
from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.moe import MoEOptions
from moetrain.models.glm4_moe import hf
from moetrain.models.glm4_moe.args import Glm4MoeArgs
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("glm4_moe")
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4 x 16 = 64: not hidden_size, as in the published models
    n_routed_experts=8,
    max_position_embeddings=4096,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
CASES = {
    # RoPE on 8 of 16 dims, q/k norms, q/k/v biases, 2 groups of which 1 is allowed (so a
    # group's score decides), one dense layer, one shared expert, scaled routed weights
    "partial_qknorm_groups": dict(
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=2.5,
    ),
    # RoPE on 12 of 16 dims with YaRN (6 frequencies: the ramp falls between them), no
    # norms, no biases, two shared experts, a tied head, two dense layers, top-3 unnormalised
    "yarn_partial_shared2_tied": dict(
        partial_rotary_factor=0.75, rope=YARN, use_qk_norm=False, attention_bias=False,
        n_shared_experts=2, tie_word_embeddings=True, first_k_dense_replace=2,
        num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5,
    ),
}  # fmt: skip
# zai-org/GLM-4.5's config.json (the published dialect; token ids left out).
PUBLISHED = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip
# zai-org/GLM-4.5-Air's differences from it.
AIR = dict(
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
    routed_scaling_factor=1.0, first_k_dense_replace=1, num_hidden_layers=46, use_qk_norm=False,
)  # fmt: skip


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norms at 1, biases and routing biases at 0, under which a norm over the
    wrong width, a dropped bias or an ignored correction bias would all go unseen."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.2 * torch.randn(buf.shape, generator=g))


def _hf_model(transformers, case: str, seed: int = 0):
    kwargs = dict(BASE, **CASES[case])
    rope = dict(kwargs.pop("rope", {"rope_type": "default"}), rope_theta=10000.0)
    rope["partial_rotary_factor"] = kwargs.pop("partial_rotary_factor")
    cfg = transformers.Glm4MoeConfig(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    _perturb(model, seed + 1)
    return model


def _ours_from_dir(model_dir, **overrides) -> torch.nn.Module:
    args = dataclasses.replace(hf.load_hf_config(str(model_dir)), **overrides)
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, str(model_dir))
    return model.eval()


def _ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], shape, generator=g)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(transformers, case, tmp_path):
    hf_model = _hf_model(transformers, case)
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    assert ours.rope_dim == int(16 * CASES[case]["partial_rotary_factor"]) < 16
    ids = _ids((2, 17), 1)
    positions = torch.arange(17) + torch.tensor([[0], [3000]])  # past YaRN's original 1024
    with torch.no_grad():
        theirs = hf_model(ids, position_ids=positions).logits
        logits = ours(ids, positions).logits
        for buf in ours.buffers():  # the correction biases must steer routing
            buf.zero_()
        unbiased = ours(ids, positions).logits
    diff = (logits - theirs).abs().max().item()
    print(f"\n{case}: max |logit diff| = {diff:.3g} (logits up to {theirs.abs().max():.2f})")
    assert diff < 1e-4
    assert (unbiased - logits).abs().max() > 1e-3


def test_packed_documents_equal_transformers_run_per_document(transformers, tmp_path):
    hf_model = _hf_model(transformers, "partial_qknorm_groups")
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    lengths = [9, 4, 11]
    docs = [_ids((n,), 10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, document_positions(document_ids), document_ids).logits[0]
        alone = torch.cat([hf_model(d[None]).logits[0] for d in docs])
    diff = (out - alone).abs().max().item()
    print(f"\npacked: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_reloads_in_transformers_and_back(transformers, case, tmp_path):
    args = hf.args_from_hf_config(_hf_model(transformers, case).config.to_dict())
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb(ours, seed=4)
    ours(_ids((1, 8), 0)).logits.sum().backward()  # a training forward: counts routing
    assert all(b.sum() > 0 for n, b in ours.named_buffers() if n.endswith("tokens_per_expert"))
    save_hf_checkpoint(ours.eval(), SPEC.hf_adapter, args, str(tmp_path))
    assert not [k for k in load_file(tmp_path / "model.safetensors") if "tokens_per" in k]

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.Glm4MoeForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, positions = _ids((2, 13), 5), torch.arange(13) + torch.tensor([[0], [2000]])
    with torch.no_grad():
        want = ours(ids, positions).logits
        diff = (reloaded.eval()(ids, position_ids=positions).logits - want).abs().max().item()
        back = _ours_from_dir(tmp_path)
        again = back(ids, positions).logits
    print(f"\nexport {case}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4
    assert back.args == args
    assert torch.equal(again, want)
    assert all(not b.any() for n, b in back.named_buffers() if n.endswith("tokens_per_expert"))


def test_mtp_layer_keys_are_skipped_but_not_other_extra_layers(transformers, tmp_path):
    _hf_model(transformers, "partial_qknorm_groups").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)
    L = BASE["num_hidden_layers"]  # the MTP layer of a released checkpoint: layer L
    extra = {f"model.layers.{L}.{k}": torch.ones(4, 4) for k in (
        "eh_proj.weight", "enorm.weight", "shared_head.head.weight", "embed_tokens.weight",
        "self_attn.q_proj.weight", "mlp.experts.0.gate_proj.weight",
    )}  # fmt: skip
    save_file({**weights, **extra}, path, metadata={"format": "pt"})
    _ours_from_dir(tmp_path)  # loads: every extra key is redundant
    with pytest.raises(HFFormatError, match=rf"model\.layers\.{L}\."):
        _ours_from_dir(tmp_path, num_nextn_predict_layers=0)  # not an MTP layer then
    del extra[f"model.layers.{L}.eh_proj.weight"]  # a decoder layer config.json left out
    save_file({**weights, **extra}, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=rf"model\.layers\.{L}\."):
        _ours_from_dir(tmp_path)


@pytest.mark.parametrize(
    "args",
    [
        Glm4MoeArgs(),
        Glm4MoeArgs(**BASE, partial_rotary_factor=0.25, rope_type="yarn", rope_factor=4.0,
                    rope_original_max_position_embeddings=1024, tie_word_embeddings=True),
    ],
    ids=["published", "tiny_yarn_tied"],
)  # fmt: skip
def test_config_json_round_trip(transformers, args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    assert hf.load_hf_config(str(tmp_path)) == args
    # transformers reads it to the same architecture and writes it back in its dialect
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    assert hf.load_hf_config(str(tmp_path / "v5")) == args


def test_published_configs_give_our_defaults_and_the_air_config(transformers, tmp_path):
    assert hf.args_from_hf_config(PUBLISHED) == Glm4MoeArgs()
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert hf.load_hf_config(str(tmp_path / "v5")) == Glm4MoeArgs()
    air = load_config(["--config", "configs/glm4_5_air.toml"]).model.args
    assert hf.args_from_hf_config(dict(PUBLISHED, **AIR)) == air
    # keys a config.json leaves out take transformers' defaults, not ours
    sparse = hf.args_from_hf_config({"model_type": "glm4_moe", "num_attention_heads": 32})
    assert (sparse.head_dim, sparse.routed_scaling_factor, sparse.use_qk_norm) == (128, 1.0, False)
    assert (sparse.partial_rotary_factor, sparse.rope_theta, sparse.attention_bias) == (
        0.5, 10000.0, False,
    )  # fmt: skip


def test_refusals_name_the_key_and_the_fix():
    cases = [
        (dict(model_type="deepseek_v3"), "model_type 'deepseek_v3', expected 'glm4_moe'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'; only 'silu'"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1 .*set it to 0.0"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling .*'linear'.*remove"),
        (dict(n_group=3), r"n_routed_experts \(160\) must split into model.n_group \(3\)"),
        (dict(partial_rotary_factor=0.2), r"partial_rotary_factor \(int\(128 \* 0.2\) = 25\)"),
    ]
    for change, match in cases:
        with pytest.raises(HFFormatError, match=match):
            hf.args_from_hf_config(dict(PUBLISHED, **change))
    # partial 0.3 of 128 is 38 dims: even, so allowed; 0.25 of 12 is 3, odd
    assert Glm4MoeArgs(partial_rotary_factor=0.3).validate() == []
    assert "must be even" in Glm4MoeArgs(head_dim=12, partial_rotary_factor=0.25).validate()[0]


def test_flops_count_full_width_attention_and_top_k_experts():
    args = Glm4MoeArgs(**BASE, **{k: v for k, v in CASES["partial_qknorm_groups"].items()})
    with torch.device("meta"):
        model = SPEC.build(args)
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    others = sum(p.numel() for n, p in params.items() if ".experts." not in n)
    active = others - args.vocab_size * args.hidden_size + experts * 2 / 8
    attention = 6 * 3 * 4 * (16 + 16) * 64  # head_dim wide: partial rotary changes no matmul
    assert SPEC.flops_per_token(model, 64) == pytest.approx(6 * active + attention)
    assert SPEC.loss_terms(args).aux_loss_coef == 0.0  # transformers' GLM-4.5 has none


@pytest.mark.slow
def test_train_py_losses_agree_on_every_layout(tmp_path, monkeypatch):
    """configs/debug_glm4_moe.toml on 1 rank, then 2 ranks: FSDP, EP 2, CP 2, CP 2 x EP 2."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    common = [
        "--config=configs/debug_glm4_moe.toml",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",  # 4 zigzag chunks of 16 at cp 2
        "--data.max_tokens=200000",
        "--metrics.log_interval=1",
    ]
    one = run_train(common, tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3]
    print(f"\n1 rank: losses {[r['loss'] for r in one]}, norms {[r['grad_norm'] for r in one]}")
    layouts = {"fsdp2": [], "ep2": ["--parallel.ep=2"], "cp2": ["--parallel.cp=2"],
               "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"]}  # fmt: skip
    for name, layout in layouts.items():
        run = run_train(common + layout, tmp_path / name, nproc=2)
        print(f"\n{name}: losses {[r['loss'] for r in run]}, norms {[r['grad_norm'] for r in run]}")
        for key in ("loss", "grad_norm"):
            want = [r[key] for r in one]
            assert [r[key] for r in run] == pytest.approx(want, rel=1e-5), (name, key)
