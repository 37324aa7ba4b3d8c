"""OLMoE added through the model contract alone: parity with transformers' OlmoeForCausalLM
(eager, fp32, tiny random configs), HF export and config.json round trips, and train.py
through the front door on 1 rank, expert parallelism and context parallelism."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.args import field_problems
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoEOptions
from moetrain.models.olmoe import hf
from moetrain.models.olmoe.args import OlmoeArgs
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("olmoe")
CLIP = 0.8  # below the typical |q|, |k| (rms 1 after their norms) and |v|: clamping bites

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    rope_theta=10000.0,
    router_aux_loss_coef=0.01,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
CASES = {
    "gqa_topk_norm": dict(norm_topk_prob=True),
    "mha_tied": dict(norm_topk_prob=False, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_clip_bias": dict(norm_topk_prob=False, clip_qkv=CLIP, attention_bias=True),
    "mqa_clip_tied_topk_norm": dict(
        norm_topk_prob=True, num_key_value_heads=1, clip_qkv=CLIP, tie_word_embeddings=True
    ),
}

# allenai/OLMoE-1B-7B-0924's config.json (the published dialect), whose values our
# defaults are.
PUBLISHED = {
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@torch.no_grad()
def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norm weights at 1 and biases at 0, under which a norm over the wrong
    width, a clamp on the wrong side of a norm or a dropped bias would all go unseen."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            p.add_(0.5 * torch.randn(p.shape, generator=g))


def _hf_model(transformers, overrides: dict, seed: int = 0):
    kwargs = dict(BASE, **overrides)
    rope_theta = kwargs.pop("rope_theta")
    cfg = transformers.OlmoeConfig(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.OlmoeForCausalLM(cfg).eval()
    _perturb_norms_and_biases(model, seed + 1)
    return model


def _ours_from_dir(model_dir: str):
    args = hf.load_hf_config(model_dir)
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, model_dir)
    return model.eval()


def _batch(seed: int, seq: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, BASE["vocab_size"], (2, seq), generator=g)
    labels = torch.randint(0, BASE["vocab_size"], (2, seq), generator=g)
    return input_ids, labels


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_transformers(transformers, case, tmp_path):
    hf_model = _hf_model(transformers, CASES[case])
    hf_model.save_pretrained(tmp_path / "hf")
    ours = _ours_from_dir(str(tmp_path / "hf"))
    assert ours.args.clip_qkv == CASES[case].get("clip_qkv")

    input_ids, labels = _batch(1)
    # HF shifts the labels inside its loss; ours are aligned with positions already.
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        hf_out = hf_model(input_ids, labels=labels, output_router_logits=True)
        out = ours(input_ids)
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    aux = load_balancing_loss(out.router_stats, ours.args.num_experts, pooled=True)
    loss = ce + ours.args.router_aux_loss_coef * aux

    diff = (out.logits - hf_out.logits).abs().max().item()
    print(f"\n{case}: max |logit diff| = {diff:.3g}, loss {loss.item():.6f} vs {hf_out.loss:.6f}")
    assert diff < 1e-4
    torch.testing.assert_close(aux, hf_out.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gqa_clip_bias", "mqa_clip_tied_topk_norm"])
def test_clip_qkv_actually_clamps(transformers, case, tmp_path):
    """The parity above means something for clip_qkv only if the clamp changes the output."""
    hf_model = _hf_model(transformers, CASES[case])
    hf_model.save_pretrained(tmp_path)
    clipped = _ours_from_dir(str(tmp_path))
    unclipped = SPEC.build(dataclasses.replace(clipped.args, clip_qkv=None)).eval()
    unclipped.load_state_dict(clipped.state_dict())
    input_ids, _ = _batch(1)
    with torch.no_grad():
        change = (clipped(input_ids).logits - unclipped(input_ids).logits).abs().max().item()
    assert change > 1e-2


@pytest.mark.parametrize("case", ["mha_tied", "gqa_clip_bias"])
def test_export_of_a_native_model_reloads_in_transformers(transformers, case, tmp_path):
    # The second case also writes head_dim (explicit, = hidden / heads) into config.json.
    extra = {"head_dim": 8} if case == "gqa_clip_bias" else {}
    args = OlmoeArgs(**dict(BASE, **CASES[case], **extra))
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb_norms_and_biases(ours, seed=4)
    ours.eval()
    save_hf_checkpoint(ours, SPEC.hf_adapter, args, str(tmp_path))

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.OlmoeForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    input_ids, _ = _batch(2, seq=13)
    with torch.no_grad():
        diff = (reloaded.eval()(input_ids).logits - ours(input_ids).logits).abs().max().item()
    print(f"\nexport {case}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize(
    "args",
    [
        OlmoeArgs(),
        OlmoeArgs(**BASE, clip_qkv=2.5, tie_word_embeddings=True, norm_topk_prob=True),
        OlmoeArgs(**BASE, head_dim=8, attention_bias=True),  # explicit, = hidden / heads
    ],
    ids=["published", "tiny_clip_tied", "explicit_head_dim"],
)
def test_config_json_round_trip(args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    assert hf.load_hf_config(str(tmp_path)) == args


def test_both_config_dialects_give_the_published_defaults(transformers, tmp_path):
    assert hf.args_from_hf_config(PUBLISHED) == OlmoeArgs()
    # transformers 5 reads the published file and writes its own dialect: rope_parameters
    # instead of rope_theta and rope_scaling (a non-default theta shows which one we read).
    published = dict(PUBLISHED, rope_theta=50000.0)
    (tmp_path / "config.json").write_text(json.dumps(published))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert "rope_theta" not in v5 and "rope_scaling" not in v5
    want = OlmoeArgs(rope_theta=50000.0)
    assert hf.load_hf_config(str(tmp_path)) == hf.load_hf_config(str(tmp_path / "v5")) == want
    # transformers' own defaults for absent keys (intermediate_size 2048, kv heads = heads).
    sparse = hf.args_from_hf_config({"model_type": "olmoe", "num_attention_heads": 8})
    assert (sparse.intermediate_size, sparse.num_key_value_heads) == (2048, 8)


def test_refusals_name_the_key_and_the_fix():
    with pytest.raises(HFFormatError, match="model_type"):
        hf.args_from_hf_config({"model_type": "llama"})
    linear = dict(PUBLISHED, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(HFFormatError, match="rope_scaling.*'linear'.*remove the scaling"):
        hf.args_from_hf_config(linear)
    yarn = dict(PUBLISHED, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(HFFormatError, match="rope_parameters.*'yarn'"):
        hf.args_from_hf_config(yarn)
    with pytest.raises(HFFormatError, match="hidden_act"):
        hf.args_from_hf_config(dict(PUBLISHED, hidden_act="gelu"))
    with pytest.raises(HFFormatError, match="unset model.head_dim"):
        hf.hf_config_dict(OlmoeArgs(**BASE, head_dim=12))


def test_bounds_and_cross_field_checks():
    bad = OlmoeArgs(hidden_size=0, clip_qkv=-1.0, router_aux_loss_coef=-0.1)
    problems = field_problems(bad, "model")
    assert any(p.startswith("model.hidden_size must be > 0") for p in problems), problems
    assert any(p.startswith("model.clip_qkv must be > 0") for p in problems), problems
    assert any("router_aux_loss_coef must be >= 0 (0 = off)" in p for p in problems), problems
    assert bad.validate() == []  # out-of-range values are the bounds' to report
    assert field_problems(OlmoeArgs(), "model") == OlmoeArgs().validate() == []
    crossed = OlmoeArgs(
        num_attention_heads=6, num_key_value_heads=4, hidden_size=100, num_experts_per_tok=65
    )
    problems = crossed.validate()
    assert len(problems) == 3, problems
    assert "multiple of model.num_key_value_heads" in problems[0]
    assert "hidden_size (100) must be a multiple" in problems[1]
    assert "num_experts_per_tok (65)" in problems[2]
    assert "even for RoPE" in OlmoeArgs(hidden_size=48, num_attention_heads=16).validate()[0]


def test_flops_and_plan_cover_the_model():
    args = OlmoeArgs(**BASE)
    with torch.device("meta"):
        model = SPEC.build(args)
    names = {n for n, _ in model.named_modules()}
    assert {"layers.0.mlp.experts", "layers.2.self_attn.core", "layers.1.mlp.gate"} <= names
    # Experts count top_k / num_experts of their size; the input embedding is a lookup.
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    active = dense - args.vocab_size * args.hidden_size + experts * 2 / 8
    attention = 6 * 3 * 4 * (8 + 8) * 64
    assert SPEC.flops_per_token(model, 64) == pytest.approx(6 * active + attention)
    assert SPEC.loss_terms(args).aux_loss_coef == 0.01


@pytest.mark.slow
def test_train_py_losses_agree_on_one_rank_ep_and_cp(tmp_path, monkeypatch):
    """configs/debug_olmoe.toml through train.py: 1 rank; 4 ranks in 2 pipeline stages with
    EP 2; 2 ranks CP 2."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    # Global batch 8 = micro 2 x 2 data-parallel ranks x 2 micro-batches (the pp run); seq_len
    # 64 splits into the 2 * cp pieces of the zigzag layout.
    common = [
        "--config=configs/debug_olmoe.toml",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",
        "--data.max_tokens=200000",
        "--metrics.log_interval=1",
    ]
    one = run_train(common, tmp_path / "one")
    pp_ep = ["--parallel.pp=2", "--parallel.ep=2"]
    four_ep = run_train(common + pp_ep, tmp_path / "four_ep", nproc=4)
    two_cp = run_train(common + ["--parallel.cp=2"], tmp_path / "two_cp", nproc=2)
    losses = [r["loss"] for r in one]
    for label, run in (("1 rank", one), ("4 ranks pp=2 ep=2", four_ep), ("2 ranks cp=2", two_cp)):
        print(f"\n{label}: losses {[r['loss'] for r in run]}")
    assert [r["step"] for r in one] == [1, 2, 3]
    for run in (four_ep, two_cp):
        assert [r["loss"] for r in run] == pytest.approx(losses, rel=1e-5)
