"""Qwen2-MoE added through the model contract: parity with transformers' Qwen2MoeForCausalLM
(eager, fp32, tiny random configs: dense layers by sparse step and by mlp_only_layers, GQA,
q/k/v biases, the sigmoid-gated shared expert, top-k with and without renormalisation, a
tied head, YaRN), packed documents against transformers run per document, HF export and
config.json round trips, refusals, and train.py on every layout."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import load_config
from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoE, MoEOptions
from moetrain.models.qwen2_moe import hf
from moetrain.models.qwen2_moe.args import Qwen2MoeArgs
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("qwen2_moe")
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_experts=8,
    rope_theta=10000.0,
    max_position_embeddings=64,
    router_aux_loss_coef=0.01,
    initializer_range=0.2,  # larger than default so routing, attention and gates are not flat
)
CASES = {
    # layers 1 and 3 MoE (0 and 2 dense), 2 query heads per K/V head, raw top-3 weights
    "sparse_step2_gqa_bias": dict(
        decoder_sparse_step=2, num_key_value_heads=2, num_experts_per_tok=3, norm_topk_prob=False
    ),
    # layer 0 dense by mlp_only_layers, renormalised top-2, tied head, no q/k/v bias, YaRN
    "mlp_only_tied_topk_norm_yarn": dict(
        mlp_only_layers=[0],
        num_key_value_heads=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        qkv_bias=False,
        rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
}
MOE_LAYERS = {"sparse_step2_gqa_bias": [1, 3], "mlp_only_tied_topk_norm_yarn": [1, 2, 3]}

# Qwen/Qwen1.5-MoE-A2.7B's config.json (transformers-4 dialect), whose values our defaults are.
PUBLISHED = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24,
    "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
}  # fmt: skip
# Qwen/Qwen2-57B-A14B's, which configs/qwen2_57b_a14b.toml restates.
QWEN2_57B = dict(
    PUBLISHED, hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072,
    max_window_layers=28, num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4,
    sliding_window=131072, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
    num_experts_per_tok=8, num_experts=64,
)  # fmt: skip


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def _args(case: str) -> Qwen2MoeArgs:
    kwargs = dict(BASE, **CASES[case])
    rope = kwargs.pop("rope", {})
    if rope:
        kwargs.update(rope_type=rope["rope_type"], rope_factor=rope["factor"])
        kwargs["rope_original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return Qwen2MoeArgs(**kwargs)


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norms at 1 and biases at 0, under which a norm or a bias dropped would go
    unseen; the shared experts' gates get larger weights, so that sigmoid(gate) ranges wide."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            p.add_(0.5 * torch.randn(p.shape, generator=g))
        if "shared_expert_gate" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _hf_model(transformers, case: str, seed: int = 0):
    kwargs = dict(BASE, **CASES[case])
    rope = dict(rope_type="default", rope_theta=kwargs.pop("rope_theta"))
    rope.update(kwargs.pop("rope", {}))
    cfg = transformers.Qwen2MoeConfig(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    _perturb(model, seed + 1)
    return model


def _ours_from_dir(model_dir) -> torch.nn.Module:
    args = hf.load_hf_config(str(model_dir))
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, str(model_dir))
    return model.eval()


def _ids(seed: int, shape=(2, 17)) -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_aux_and_loss_match_transformers(transformers, case, tmp_path):
    hf_model = _hf_model(transformers, case)
    hf_model.save_pretrained(tmp_path)  # per-expert keys, `mlp.shared_expert`: read as such
    ours = _ours_from_dir(tmp_path)
    assert ours.args == _args(case)
    moe = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, MoE)]
    theirs_moe = [i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate")]
    assert moe == theirs_moe == MOE_LAYERS[case]

    ids, labels = _ids(1), _ids(2)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # HF shifts inside its loss
    with torch.no_grad():
        theirs = hf_model(ids, labels=labels, output_router_logits=True)
        out = ours(ids)
    diff = (out.logits - theirs.logits).abs().max().item()
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    aux = load_balancing_loss(out.router_stats, ours.args.num_experts, pooled=True)
    loss = ce + ours.args.router_aux_loss_coef * aux
    print(f"\n{case}: max |logit diff| = {diff:.3g} (logits up to {out.logits.abs().max():.2f})")
    assert diff < 1e-4
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-5)


def test_the_shared_expert_gate_bites(transformers, tmp_path):
    """Parity means something for the gate only if the output depends on it."""
    _hf_model(transformers, "sparse_step2_gqa_bias").save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    ids = _ids(1)
    with torch.no_grad():
        gated = ours(ids).logits
        for i in MOE_LAYERS["sparse_step2_gqa_bias"]:
            ours.layers[i].mlp.shared_expert_gate = None  # the shared expert, ungated
        ungated = ours(ids).logits
    assert (gated - ungated).abs().max().item() > 1e-2


def test_packed_documents_equal_transformers_run_per_document(transformers, tmp_path):
    hf_model = _hf_model(transformers, "sparse_step2_gqa_bias")
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    lengths = [9, 4, 11]
    docs = [_ids(10 + i, (n,)) for i, n in enumerate(lengths)]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, document_positions(document_ids), document_ids).logits[0]
        alone = torch.cat([hf_model(d[None]).logits[0] for d in docs])
    diff = (out - alone).abs().max().item()
    print(f"\npacked: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_reloads_in_transformers(transformers, case, tmp_path):
    args = _args(case)
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb(ours, seed=4)
    save_hf_checkpoint(ours.eval(), SPEC.hf_adapter, args, str(tmp_path))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.Qwen2MoeForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = _ids(5, (2, 13))
    with torch.no_grad():
        diff = (reloaded.eval()(ids).logits - ours(ids).logits).abs().max().item()
    print(f"\nexport {case}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4
    assert hf.load_hf_config(str(tmp_path)) == args  # and back


def test_config_json_round_trip(tmp_path):
    for args in [Qwen2MoeArgs(), *map(_args, sorted(CASES))]:
        (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
        assert hf.load_hf_config(str(tmp_path)) == args


def test_published_configs_give_the_defaults_and_the_57b_toml(transformers, tmp_path):
    assert hf.args_from_hf_config(PUBLISHED) == Qwen2MoeArgs()
    # transformers 5 reads the published file and writes its own dialect (rope_parameters,
    # layer_types, qkv_bias); a non-default theta shows which one we read.
    (tmp_path / "config.json").write_text(json.dumps(dict(PUBLISHED, rope_theta=50000.0)))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert v5["layer_types"] == ["full_attention"] * 24 and v5["qkv_bias"] is True
    want = Qwen2MoeArgs(rope_theta=50000.0)
    assert hf.load_hf_config(str(tmp_path)) == hf.load_hf_config(str(tmp_path / "v5")) == want
    # A key config.json leaves out means transformers' default (8192 positions are the
    # published file's; transformers' is 32768, its theta 10000).
    sparse = hf.args_from_hf_config({"model_type": "qwen2_moe"})
    theirs = transformers.Qwen2MoeConfig()
    for key in hf._SAME_NAME_KEYS:
        assert getattr(sparse, key) == getattr(theirs, key), key
    assert sparse.rope_theta == theirs.rope_parameters["rope_theta"]
    assert sparse.mlp_only_layers == theirs.mlp_only_layers == []
    toml = load_config(["--config=configs/qwen2_57b_a14b.toml"]).model.args
    assert toml == hf.args_from_hf_config(QWEN2_57B)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="qwen3_moe"), "model_type 'qwen3_moe', expected 'qwen2_moe'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'.*only 'silu'"),
        (dict(use_sliding_window=True), "use_sliding_window.*set use_sliding_window to false"),
        (dict(layer_types=["sliding_attention"] * 24), "layer_types.*drop layer_types"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1.*set it to 0.0"),
        (dict(head_dim=64), "head_dim=64, not .* = 128.*remove head_dim"),
        (
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_scaling has RoPE type 'linear'.*remove",
        ),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters .*remove"),
    ],
)
def test_refusals_name_the_key_and_the_fix(change, match):
    with pytest.raises(HFFormatError, match=match):
        hf.args_from_hf_config(dict(PUBLISHED, **change))


def test_cross_field_checks_and_flops():
    assert Qwen2MoeArgs().validate() == []
    crossed = Qwen2MoeArgs(num_key_value_heads=3, hidden_size=2050, num_experts_per_tok=61)
    problems = crossed.validate()
    assert len(problems) == 3 and "multiple of model.num_key_value_heads" in problems[0], problems
    assert "hidden_size (2050) must be a multiple" in problems[1]
    assert "num_experts_per_tok (61)" in problems[2]
    assert "outside [0, 24)" in Qwen2MoeArgs(mlp_only_layers=[24]).validate()[0]
    args = _args("sparse_step2_gqa_bias")
    with torch.device("meta"):
        model = SPEC.build(args)
    # Routed experts count top_k / num_experts of their size; shared experts and their
    # gates, every token's, count whole; the input embedding is a lookup.
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    rest = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
    active = rest - 96 * 32 + routed * 3 / 8
    attention = 6 * 4 * 4 * (8 + 8) * 64
    assert SPEC.flops_per_token(model, 64) == pytest.approx(6 * active + attention)


@pytest.mark.slow
def test_train_py_losses_agree_on_every_layout(tmp_path, monkeypatch):
    """configs/debug_qwen2_moe.toml (a dense block among MoE blocks) on 1 rank, then 2 ranks:
    FSDP, EP 2, CP 2, CP 2 x EP 2."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    common = [
        "--config=configs/debug_qwen2_moe.toml",
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
    layouts = {"fsdp2": [], "ep2": ["--parallel.ep=2"], "cp2": ["--parallel.cp=2"],
               "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"]}  # fmt: skip
    for name, layout in layouts.items():
        run = run_train(common + layout, tmp_path / name, nproc=2)
        print(f"\n{name}: losses {[r['loss'] for r in run]}")
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in run] == pytest.approx([r[key] for r in one], rel=1e-5), name
