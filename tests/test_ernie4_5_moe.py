"""ERNIE-4.5 MoE added through the model contract: parity with transformers'
Ernie4_5_MoeForCausalLM (eager, fp32, tiny random configs with non-zero correction biases:
MoE layers by start/end index and by interval, shared experts on and off, biases on and off,
tied and untied heads, YaRN), packed documents against transformers run per document, HF
import (both key spellings of the routing bias, MTP keys skipped) and export (reloaded in
transformers), config.json round trips, refusals, and train.py in pipeline stages with
CP and EP."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moetrain.config import load_config
from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import HFFormatError, get_model_spec
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoE, MoEOptions
from moetrain.models.ernie4_5_moe import hf
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs
from moetrain.models.ernie4_5_moe.model import TiedHeadBias
from tests.distributed import ROOT, run_train

SPEC = get_model_spec("ernie4_5_moe")
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4 x 16 = 64: not hidden_size / heads
    moe_num_experts=8,
    max_position_embeddings=4096,
    router_aux_loss_coef=0.01,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
CASES = {
    # layers 1..3 of 5 MoE (0 by the start index, 4 by the end index), 2 shared experts,
    # biases everywhere, an untied head with its bias
    "start1_end3_shared2_bias_untied": dict(
        num_hidden_layers=5, moe_layer_start_index=1, moe_layer_end_index=3,
        moe_num_shared_experts=2, use_bias=True, tie_word_embeddings=False, moe_k=2,
    ),
    # every 2nd layer MoE (1 and 3; 0 and 2 dense), no shared experts, no biases, a tied
    # head, top-3
    "interval2_noshared_tied": dict(
        num_hidden_layers=4, moe_layer_start_index=0, moe_layer_interval=2,
        moe_num_shared_experts=0, use_bias=False, tie_word_embeddings=True, moe_k=3,
    ),
    # every layer MoE, 1 shared expert, a tied head that keeps its own bias, YaRN
    "all_moe_shared1_tied_bias_yarn": dict(
        num_hidden_layers=3, moe_layer_start_index=0, moe_num_shared_experts=1,
        use_bias=True, tie_word_embeddings=True, moe_k=2, rope=YARN,
    ),
}  # fmt: skip
MOE_LAYERS = {
    "start1_end3_shared2_bias_untied": [1, 2, 3],
    "interval2_noshared_tied": [1, 3],
    "all_moe_shared1_tied_bias_yarn": [0, 1, 2],
}
# A config.json in the published dialect of the 21B-A3B's shape: a top-level rope_theta,
# the end index written out, and keys of Baidu's own code that transformers ignores.
PUBLISHED = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "num_attention_heads": 20, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 28, "rms_norm_eps": 1e-05, "vocab_size": 103424,
    "rope_theta": 500000, "use_bias": False, "tie_word_embeddings": True,
    "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_k": 6,
    "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_layer_interval": 1,
    "moe_intermediate_size": 1536, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
    "moe_gate": "topk", "moe_use_aux_free": True, "num_nextn_predict_layers": 1,
}  # fmt: skip


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def _hf_kwargs(case: str) -> tuple[dict, dict]:
    kwargs = dict(BASE, **CASES[case])
    rope = dict(kwargs.pop("rope", {"rope_type": "default"}), rope_theta=10000.0)
    return kwargs, rope


def _args(case: str) -> Ernie45MoeArgs:
    kwargs, rope = _hf_kwargs(case)
    kwargs.update(rope_type=rope["rope_type"], rope_theta=rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        kwargs.update(rope_factor=rope["factor"])
        kwargs["rope_original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return Ernie45MoeArgs(**kwargs)


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Init leaves norms at 1, biases and routing biases at 0, under which a dropped bias or
    an ignored correction bias would go unseen. The routing biases are the size of the
    probabilities' spread (1/8 on average), so they change which experts are chosen."""
    g = torch.Generator().manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "norm" in name or name.endswith(".bias"):
            t.add_(0.5 * torch.randn(t.shape, generator=g))
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g))


def _hf_model(transformers, case: str, seed: int = 0):
    kwargs, rope = _hf_kwargs(case)
    cfg = transformers.Ernie4_5_MoeConfig(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Ernie4_5_MoeForCausalLM(cfg).eval()
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
def test_logits_and_loss_match_transformers(transformers, case, tmp_path):
    hf_model = _hf_model(transformers, case)
    hf_model.save_pretrained(tmp_path)  # per-expert keys, `mlp.moe_statics` [1, E]: read as such
    ours = _ours_from_dir(tmp_path)
    moe = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, MoE)]
    theirs_moe = [i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate")]
    assert moe == theirs_moe == MOE_LAYERS[case]
    # transformers saves moe_layer_end_index resolved (-1 -> L - 1): the same layers
    assert dataclasses.replace(ours.args, moe_layer_end_index=_args(case).moe_layer_end_index) == (
        _args(case)
    )
    assert isinstance(ours.lm_head, TiedHeadBias) == (case == "all_moe_shared1_tied_bias_yarn")

    ids, labels = _ids((2, 17), 1), _ids((2, 17), 2)
    positions = torch.arange(17) + torch.tensor([[0], [3000]])  # past YaRN's original 1024
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # HF shifts inside its loss
    with torch.no_grad():
        theirs = hf_model(ids, position_ids=positions, labels=labels)
        out = ours(ids, positions)
        for name, buf in ours.named_buffers():  # the correction biases must steer routing
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
        unbiased = ours(ids, positions).logits
    diff = (out.logits - theirs.logits).abs().max().item()
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    print(f"\n{case}: max |logit diff| = {diff:.3g} (logits up to {theirs.logits.abs().max():.2f})")
    assert diff < 1e-4
    torch.testing.assert_close(ce, theirs.loss, rtol=1e-5, atol=1e-5)
    assert (unbiased - out.logits).abs().max() > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_pooled_aux_with_a_correction_bias_is_transformers_value(transformers, case, tmp_path):
    """Hugging Face's aux counts the top-k of the unbiased probabilities, whatever the bias
    chose; so does ours (moetrain.models.common.balance_losses), with the case's non-zero bias."""
    hf_model = _hf_model(transformers, case)
    biases = [t for n, t in hf_model.named_parameters() if n.endswith("e_score_correction_bias")]
    biases += [t for n, t in hf_model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases)
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(tmp_path)
    ids, labels = _ids((2, 17), 1), _ids((2, 17), 2)
    with torch.no_grad():
        theirs = hf_model(ids, labels=labels, output_router_logits=True)
        out = ours(ids)
    aux = load_balancing_loss(out.router_stats, ours.args.moe_num_experts, pooled=True)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=1e-6)


def test_packed_documents_equal_transformers_run_per_document(transformers, tmp_path):
    hf_model = _hf_model(transformers, "start1_end3_shared2_bias_untied")
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
    args = _args(case)
    ours = SPEC.build(args, MoEOptions(gemm="loop"))
    ours.init_weights(seed=3)
    _perturb(ours, seed=4)
    ours(_ids((1, 8), 0)).logits.sum().backward()  # a training forward: counts routing
    assert all(b.sum() > 0 for n, b in ours.named_buffers() if n.endswith("tokens_per_expert"))
    save_hf_checkpoint(ours.eval(), SPEC.hf_adapter, args, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    assert not [k for k in saved if "tokens_per" in k]
    layer = MOE_LAYERS[case][0]
    bias = saved[f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 8)
    assert torch.equal(bias[0], ours.layers[layer].mlp.gate.e_score_correction_bias)

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.Ernie4_5_MoeForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
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


def test_in_memory_names_read_and_mtp_keys_skipped(transformers, tmp_path):
    """transformers-5's in-memory names (stacked experts, the bias under `mlp.gate`) read as
    the saved ones do; the released checkpoints' MTP keys are skipped as transformers skips
    them, and any other unread key is still refused."""
    case = "start1_end3_shared2_bias_untied"
    hf_model = _hf_model(transformers, case)
    hf_model.save_pretrained(tmp_path / "saved")
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    state = {k: v.clone().contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias" in state
    state["mtp_block.0.self_attn.q_proj.weight"] = torch.ones(4, 4)
    state["mtp_linear_proj.0.weight"] = torch.ones(4, 4)
    save_file(state, memory / "model.safetensors", metadata={"format": "pt"})
    ids = _ids((2, 11), 3)
    with torch.no_grad():
        want = _ours_from_dir(tmp_path / "saved")(ids).logits
        assert torch.equal(_ours_from_dir(memory)(ids).logits, want)
    state["model.layers.1.mlp.extra.weight"] = torch.ones(4, 4)
    save_file(state, memory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"model\.layers\.1\.mlp\.extra\.weight"):
        _ours_from_dir(memory)


@pytest.mark.parametrize(
    "args",
    [Ernie45MoeArgs(), _args("all_moe_shared1_tied_bias_yarn"), _args("interval2_noshared_tied")],
    ids=["published", "tiny_yarn_tied_bias", "tiny_interval2"],
)
def test_config_json_round_trip(transformers, args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_dict(args, torch.bfloat16)))
    assert hf.load_hf_config(str(tmp_path)) == args
    # transformers reads it to the same architecture and writes it back in its dialect, the
    # end index resolved (-1 -> the last layer)
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "v5")
    back = hf.load_hf_config(str(tmp_path / "v5"))
    assert back.moe_layer_end_index == args.num_hidden_layers - 1
    assert dataclasses.replace(back, moe_layer_end_index=-1) == args


def test_published_config_gives_the_21b_toml_and_missing_keys_transformers_defaults(
    transformers,
):
    toml = load_config(["--config=configs/ernie4_5_21b_a3b.toml"]).model.args
    assert hf.args_from_hf_config(PUBLISHED) == toml
    assert dataclasses.replace(toml, moe_layer_end_index=-1) == Ernie45MoeArgs()
    # A key config.json leaves out means transformers' default, ERNIE's theta included.
    sparse = hf.args_from_hf_config({"model_type": "ernie4_5_moe"})
    theirs = transformers.Ernie4_5_MoeConfig()
    for key in hf._SAME_NAME_KEYS:
        if key != "moe_layer_end_index":  # transformers resolves -1 when it reads
            assert getattr(sparse, key) == getattr(theirs, key), key
    assert sparse.rope_theta == theirs.rope_parameters["rope_theta"] == 500000.0
    assert [sparse.is_moe_layer(i) for i in range(28)] == [False] + [True] * 27
    aliased = hf.args_from_hf_config({"num_experts": 16, "num_experts_per_tok": 4})
    assert (aliased.moe_num_experts, aliased.moe_k) == (16, 4)


def test_refusals_name_the_key_and_the_fix():
    cases = [
        (dict(model_type="qwen3_moe"), "model_type 'qwen3_moe', expected 'ernie4_5_moe'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'; only 'silu'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling .*'linear'.*remove"),
        (dict(moe_k=65), r"model.moe_k \(65\) must be <= model.moe_num_experts \(64\)"),
        (dict(num_key_value_heads=3), r"num_attention_heads \(20\) must be a multiple"),
        (dict(moe_layer_end_index=-2), "model.moe_layer_end_index must be >= -1"),
    ]
    for change, match in cases:
        with pytest.raises(HFFormatError, match=match):
            hf.args_from_hf_config(dict(PUBLISHED, **change))


def test_flops_count_top_k_experts_and_a_tied_head_once():
    args = _args("all_moe_shared1_tied_bias_yarn")
    with torch.device("meta"):
        model = SPEC.build(args)
    params = dict(model.named_parameters())
    assert "lm_head.bias" in params and "lm_head.weight" not in params
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    others = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
    attention = 6 * 3 * 4 * (16 + 16) * 64
    assert SPEC.flops_per_token(model, 64) == pytest.approx(
        6 * (others + experts * 2 / 8) + attention
    )
    assert SPEC.loss_terms(args).aux_loss_coef == 0.01


@pytest.mark.slow
def test_train_py_in_pipeline_stages_with_cp_and_ep_agrees_with_one_rank(tmp_path, monkeypatch):
    """configs/debug_ernie4_5_moe.toml (a dense layer, shared experts, biases, a tied head
    with its bias, the bias update) on 1 rank, then on 4: two pipeline stages (the last with
    its copy of the tied embedding), each over cp 2 with ep 2 borrowing the cp ranks."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    common = [
        "--config=configs/debug_ernie4_5_moe.toml",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",  # 4 zigzag chunks of 16 at cp 2
        "--data.max_tokens=200000",
        "--metrics.log_interval=1",
        # Adam's first update is ~lr * g / (|g| + eps): a larger eps keeps round-off in a
        # near-zero gradient from becoming an lr-sized difference (docs/models.md,
        # "Adding a model").
        "--train.eps=1e-4",
    ]
    one = run_train(common, tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3]
    layout = ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2"]
    run = run_train(common + layout, tmp_path / "pp2_cp2_ep2", nproc=4)
    print(f"\n1 rank: losses {[r['loss'] for r in one]}, norms {[r['grad_norm'] for r in one]}")
    print(f"pp2 cp2 ep2: losses {[r['loss'] for r in run]}, norms {[r['grad_norm'] for r in run]}")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in run] == pytest.approx([r[key] for r in one], rel=1e-5), key
