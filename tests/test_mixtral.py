"""Mixtral added through the model contract: parity with transformers' MixtralForCausalLM
(eager, fp32, tiny random configs: a window shorter than the sequence with GQA; MHA, a tied
head, an explicit head_dim and top-3), packed documents against transformers run per
document, HF export and config round trips, refusals, and train.py on every layout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.args import field_problems
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoEOptions
from moetrain.models.mixtral import hf
from moetrain.models.mixtral.args import MixtralArgs
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("mixtral")
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=8,
    num_local_experts=6,
    max_position_embeddings=256,
    rope_theta=10000.0,
    router_aux_loss_coef=0.02,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
CASES = {
    # a 5-token window on every layer of a 17-token sequence, 2 query heads per K/V head
    "window_gqa_top2": dict(num_key_value_heads=2, num_experts_per_tok=2, sliding_window=5),
    # full attention, every head its own K/V, a tied head, head_dim 12 != 32 / 4, top-3
    "mha_tied_top3": dict(
        num_key_value_heads=4, num_experts_per_tok=3, tie_word_embeddings=True, head_dim=12
    ),
}

# mistralai/Mixtral-8x7B-v0.1's config.json (the published dialect), whose values our
# defaults are.
PUBLISHED = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


@torch.no_grad()
def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norm weights at 1, under which a norm in the wrong place or over the wrong
    width would go unseen."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.5 * torch.randn(p.shape, generator=g))


def _hf_model(transformers, overrides: dict, seed: int = 0):
    kwargs = dict(BASE, **overrides)
    rope = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    cfg = transformers.MixtralConfig(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    _perturb_norms(model, seed + 1)
    return model


def _ours_from_dir(model_dir) -> torch.nn.Module:
    args = hf.load_hf_config(str(model_dir))
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    load_hf_weights(model, SPEC.hf_adapter, args, str(model_dir))
    return model.eval()


def _ids(seed: int, seq: int = 17) -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_aux_and_loss_match_transformers(transformers, case, tmp_path):
    """Also: the checkpoint transformers saves (block_sparse_moe, per-expert w1/w3/w2) loads."""
    hf_model = _hf_model(transformers, CASES[case])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    assert ours.args == MixtralArgs(**dict(BASE, **CASES[case]))
    ids, labels = _ids(1), _ids(2)
    with torch.no_grad():
        theirs = hf_model(ids, labels=labels, output_router_logits=True)
        out = ours(ids)
    diff = (out.logits - theirs.logits).abs().max().item()
    print(f"\n{case}: max |logit diff| = {diff:.3g} (logits up to {out.logits.abs().max():.2f})")
    assert diff < 1e-4
    aux = load_balancing_loss(out.router_stats, ours.args.num_local_experts, pooled=True)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=1e-6)
    # HF shifts the labels inside its loss; ours are aligned with positions already.
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    loss = ce + SPEC.loss_terms(ours.args).aux_loss_coef * aux
    torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-5)
    if ours.args.sliding_window is not None:  # the parity means something for the window
        full = SPEC.build(dataclasses.replace(ours.args, sliding_window=None)).eval()
        full.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (full(ids).logits - out.logits).abs().max().item() > 1e-2


def test_packed_documents_equal_transformers_run_per_document(transformers, tmp_path):
    hf_model = _hf_model(transformers, CASES["window_gqa_top2"])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    g = torch.Generator().manual_seed(3)
    lengths = [9, 4, 11]  # documents longer and shorter than the 5-token window
    docs = [torch.randint(0, BASE["vocab_size"], (n,), generator=g) for n in lengths]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, document_positions(document_ids), document_ids).logits[0]
        alone = torch.cat([hf_model(d[None]).logits[0] for d in docs])
    diff = (out - alone).abs().max().item()
    print(f"\npacked documents: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_reloads_in_transformers(transformers, case, tmp_path):
    args = MixtralArgs(**dict(BASE, **CASES[case]))
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb_norms(ours, seed=4)
    save_hf_checkpoint(ours.eval(), SPEC.hf_adapter, args, str(tmp_path))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.MixtralForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids(5, seq=13)
    with torch.no_grad():
        diff = (reloaded.eval()(ids).logits - ours(ids).logits).abs().max().item()
    print(f"\nexport {case}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4
    assert hf.load_hf_config(str(tmp_path)) == args  # and back


def test_a_checkpoint_of_stacked_experts_loads_too(tmp_path):
    """transformers-5's in-memory names (`mlp.gate`, `mlp.experts.gate_up_proj`: neither
    renamed to `block_sparse_moe` nor split per expert) are read as well."""
    from safetensors.torch import save_file

    args = MixtralArgs(**dict(BASE, **CASES["window_gqa_top2"]))
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


@pytest.mark.parametrize(
    "args",
    [MixtralArgs(), *(MixtralArgs(**dict(BASE, **case)) for case in CASES.values())],
    ids=["published", *CASES],
)
def test_config_json_round_trip(args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    assert hf.load_hf_config(str(tmp_path)) == args


def test_both_config_dialects_give_the_published_defaults(transformers, tmp_path):
    assert hf.args_from_hf_config(PUBLISHED) == MixtralArgs()
    # transformers 5 reads the published file and writes its own dialect: rope_parameters
    # instead of rope_theta (a non-default theta shows which one we read), head_dim null.
    (tmp_path / "config.json").write_text(json.dumps(dict(PUBLISHED, rope_theta=50000.0)))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert v5["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    want = MixtralArgs(rope_theta=50000.0)
    assert hf.load_hf_config(str(tmp_path)) == hf.load_hf_config(str(tmp_path / "v5")) == want
    # Absent keys mean transformers' defaults, which are not all the published values.
    sparse = hf.args_from_hf_config({"model_type": "mixtral", "num_attention_heads": 16})
    assert (sparse.max_position_embeddings, sparse.router_aux_loss_coef) == (131072, 0.001)
    assert (sparse.num_key_value_heads, sparse.head_dim, sparse.rope_theta) == (16, 256, 1e6)
    assert hf.args_from_hf_config({"num_experts": 4}).num_local_experts == 4  # HF's alias


def test_refusals_name_the_key_and_the_fix():
    refused = {
        "model_type": {"model_type": "mistral"},
        "hidden_act 'gelu'.*only 'silu'": {"hidden_act": "gelu"},
        "router_jitter_noise=0.01.*set it to 0.0": {"router_jitter_noise": 0.01},
        "attention_dropout=0.1.*set it to 0.0": {"attention_dropout": 0.1},
        "rope_scaling of type 'linear'.*remove the scaling": {
            "rope_scaling": {"type": "linear", "factor": 2.0}
        },
        "rope_parameters of type 'yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    }
    for match, change in refused.items():
        with pytest.raises(HFFormatError, match=match):
            hf.args_from_hf_config(dict(PUBLISHED, **change))


def test_bounds_cross_field_checks_flops_and_plan():
    bad = MixtralArgs(hidden_size=0, sliding_window=0, router_aux_loss_coef=-0.1)
    problems = field_problems(bad, "model")
    assert any(p.startswith("model.hidden_size must be > 0") for p in problems), problems
    assert any(p.startswith("model.sliding_window must be > 0") for p in problems), problems
    assert any("router_aux_loss_coef must be >= 0 (0 = off)" in p for p in problems), problems
    assert field_problems(MixtralArgs(), "model") == MixtralArgs().validate() == []
    crossed = MixtralArgs(num_key_value_heads=5, head_dim=7, num_experts_per_tok=9).validate()
    assert len(crossed) == 3 and "multiple of model.num_key_value_heads" in crossed[0], crossed
    assert "even for RoPE" in crossed[1] and "num_experts_per_tok (9)" in crossed[2], crossed

    args = MixtralArgs(**dict(BASE, **CASES["window_gqa_top2"]))
    with torch.device("meta"):
        model = SPEC.build(args)
    names = {n for n, _ in model.named_modules()}
    assert {"layers.0.mlp.experts", "layers.2.self_attn.core", "layers.1.mlp.gate"} <= names
    # Experts count top_k / num_experts of their size; the input embedding is a lookup; a
    # query sees at most `sliding_window` of the 64 keys.
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    active = dense - args.vocab_size * args.hidden_size + experts * 2 / 6
    attention = 6 * 3 * (5 / 64) * 4 * (8 + 8) * 64
    assert SPEC.flops_per_token(model, 64) == pytest.approx(6 * active + attention)
    assert SPEC.max_positions(args) == 256 and SPEC.loss_terms(args).aux_loss_coef == 0.02


@pytest.mark.slow
def test_train_py_losses_agree_on_every_layout(tmp_path, monkeypatch):
    """configs/debug_mixtral.toml (a window shorter than the sequence) on 1 rank, then 2 ranks:
    FSDP, EP 2, CP 2, CP 2 x EP 2 (EP borrows the cp ranks)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    common = [
        "--config=configs/debug_mixtral.toml",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",  # longer than the 24-token window; 4 zigzag chunks of 16 at cp 2
        "--data.max_tokens=100000",
        "--metrics.log_interval=1",
    ]
    one = run_train(common, tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3]
    layouts = {"fsdp2": [], "ep2": ["--parallel.ep=2"], "cp2": ["--parallel.cp=2"],
               "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"]}  # fmt: skip
    print(f"\n1 rank: losses {[r['loss'] for r in one]}")
    for name, layout in layouts.items():
        run = run_train(common + layout, tmp_path / name, nproc=2)
        print(f"{name}: losses {[r['loss'] for r in run]}")
        assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in one], rel=1e-5), name
        assert [r["grad_norm"] for r in run] == pytest.approx(
            [r["grad_norm"] for r in one], rel=1e-5
        ), name
