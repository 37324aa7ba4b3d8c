"""Native DeepSeek-V3 against Hugging Face transformers (eager, fp32) on tiny random configs,
the HF adapter (both config.json dialects, export, MTP layers, refusals) and the shipped
configs of the published models."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from safetensors.torch import load_file  # noqa: E402

from moetrain.config import load_config  # noqa: E402
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint  # noqa: E402
from moetrain.models import get_model_spec  # noqa: E402
from moetrain.models.common.balance_losses import load_balancing_loss  # noqa: E402
from moetrain.models.common.moe import MoEOptions  # noqa: E402
from moetrain.models.deepseek_v3.args import DeepseekV3Args  # noqa: E402
from moetrain.models.deepseek_v3.hf import HFFormatError, args_from_hf_config, load_hf_config  # noqa: E402

SPEC = get_model_spec("deepseek_v3")

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA: as many as the heads (transformers' default is 128)
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=16,  # 8 frequencies: enough for YaRN's ramp to fall between them
    v_head_dim=6,  # not qk_nope + qk_rope: the value width must be honoured
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    initializer_range=0.2,  # larger than default so routing and attention are not flat
)
# YaRN with mscale != mscale_all_dim: cos/sin are scaled by their ratio and the softmax by
# mscale(factor, mscale_all_dim)^2, so both scales are checked.
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=1024,  # the ramp spans frequencies 1.4 to 4.4
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.8,
    mscale_all_dim=1.0,
)
# Together these cover every option: query LoRA on/off, n_group 1/2/4, YaRN on/off (with
# and without truncation), interleaved RoPE on/off, 1 and 2 shared experts, tied embeddings,
# unnormalised top-k, attention biases, 2 dense layers, rms_norm_eps != the latent norms'.
CASES = {
    "qlora_group4": {},
    "plain_q_group1_shared2_tied": dict(
        q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, tie_word_embeddings=True
    ),
    "yarn_no_interleave_shared2": dict(rope=YARN, rope_interleave=False, n_shared_experts=2),
    "yarn_v3_mscale_no_truncate_plain_q": dict(
        rope=dict(YARN, mscale=1.0, truncate=False), q_lora_rank=None, n_group=2, topk_group=1
    ),
    "no_topk_norm_bias_eps_dense2": dict(
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        attention_bias=True,
        rms_norm_eps=1e-5,
        first_k_dense_replace=2,
        num_experts_per_tok=3,
    ),
}

# The published config.json files without `auto_map`, the token ids and the version keys
# (DeepSeek-V3's fp8 quantization_config is kept: the reader refuses it, and a checkpoint
# converted to bf16 has the rest unchanged; other extra keys are ignored).
# Moonlight's has no rope_scaling; `q_lora_rank: null` means a plain q_proj.
DATA = Path(__file__).parent / "data"
DEEPSEEK_V3_CONFIG = json.loads((DATA / "deepseek_v3_config.json").read_text())
MOONLIGHT_CONFIG = json.loads((DATA / "moonlight_16b_a3b_config.json").read_text())
# config file, its published config.json, and the published parameter counts in billions:
# total (DeepSeek-V3: the HF checkpoint, 671B main model + 14B MTP module; Moonlight: its
# "16B"), and without the embedding matrices (DeepSeek-V3: the weight README's 36.6B
# activated, which excludes the input embedding only; Moonlight: the model card's 15.29B
# total and 2.24B activated, which exclude embedding and head).
PUBLISHED = {
    "deepseek_v3_671b": (
        "configs/deepseek_v3_671b.toml",
        DEEPSEEK_V3_CONFIG,
        dict(checkpoint=685, main=671, activated_without_embedding=36.6),
    ),
    "moonlight_16b_a3b": (
        "configs/moonlight_16b_a3b.toml",
        MOONLIGHT_CONFIG,
        dict(checkpoint=16, non_embedding=15.29, activated_non_embedding=2.24),
    ),
}


def _hf_config(overrides: dict):
    kwargs = dict(BASE, **overrides)
    rope = dict(kwargs.pop("rope", {"rope_type": "default"}), rope_theta=10000.0)
    cfg = transformers.DeepseekV3Config(**kwargs, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    return cfg


def _randomize_correction_bias(model: torch.nn.Module, seed: int) -> None:
    """Non-zero routing biases (both libraries initialise them to 0), so that they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)


def _hf_model(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(_hf_config(overrides)).eval()
    _randomize_correction_bias(model, seed)
    return model


def _ours(args: DeepseekV3Args, seed: int | None = None):
    model = SPEC.build(args, MoEOptions(gemm="loop"))
    if seed is not None:
        model.init_weights(seed)
        _randomize_correction_bias(model, seed)
    return model.eval()


def _ours_from_dir(model_dir: str, **arg_overrides):
    args = dataclasses.replace(load_hf_config(model_dir), **arg_overrides)
    model = _ours(args)
    load_hf_weights(model, SPEC.hf_adapter, args, model_dir)
    return model


def _ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed)
    )


# --- parity with transformers ---------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_transformers(case, tmp_path):
    hf_model = _hf_model(CASES[case])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(str(tmp_path))

    input_ids, labels = _ids((2, 17), 1), _ids((2, 17), 2)
    # The second sequence sits past YaRN's original context, where interpolation matters.
    position_ids = torch.arange(17) + torch.tensor([[0], [3000]])
    # HF shifts the labels inside its loss; ours are aligned with positions already.
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        hf_out = hf_model(input_ids, position_ids=position_ids, labels=labels)
        logits = ours(input_ids, position_ids).logits
        ce = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        # The routing bias must steer some choice, or this test would not check it.
        for buf in ours.buffers():
            buf.zero_()  # e_score_correction_bias (tokens_per_expert is 0 in eval anyway)
        unbiased = ours(input_ids, position_ids).logits

    torch.testing.assert_close(logits, hf_out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ce, hf_out.loss, rtol=1e-4, atol=1e-4)
    assert (unbiased - logits).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["qlora_group4", "no_topk_norm_bias_eps_dense2"])
def test_pooled_aux_with_a_correction_bias_is_transformers_definition(case, tmp_path):
    """Transformers' DeepSeek-V3 computes no aux loss; its pooled one is the Switch loss of
    `load_balancing_loss_func` (ERNIE-4.5's, the transformers model with a selection-only
    bias and an aux loss): P the router's probabilities, f the top-k of those same,
    unbiased probabilities. Here it is given transformers' own DeepSeek router logits as
    log(normalised sigmoid affinities), whose softmax is DeepSeek's P, with non-zero
    correction biases: ours counts the unbiased top-k too, not the experts the bias and
    the group limits chose."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import load_balancing_loss_func

    hf_model = _hf_model(CASES[case])
    hf_model.save_pretrained(tmp_path)
    ours = _ours_from_dir(str(tmp_path))
    input_ids = _ids((2, 17), 1)
    with torch.no_grad():
        router_logits = hf_model(input_ids, output_router_logits=True).router_logits
        stats = ours(input_ids).router_stats
    affinities = [logits.sigmoid() for logits in router_logits]  # [T, E] per MoE layer
    log_p = tuple((a / a.sum(-1, keepdim=True)).log() for a in affinities)
    cfg = hf_model.config
    theirs = load_balancing_loss_func(log_p, cfg.n_routed_experts, cfg.num_experts_per_tok)

    ours_aux = load_balancing_loss(stats, cfg.n_routed_experts, pooled=True)
    torch.testing.assert_close(ours_aux, theirs, rtol=1e-6, atol=1e-7)
    # The bias (and the group limits) steer the choice: counting the chosen experts would
    # give another value, so the test tells the two apart.
    assert not torch.equal(stats.tokens_per_expert, stats.prob_topk_per_expert)
    chosen = load_balancing_loss(
        stats._replace(prob_topk_per_expert=None), cfg.n_routed_experts, pooled=True
    )
    assert (chosen - theirs).abs() > 1e-3


def test_yarn_keys_missing_from_config_json_mean_what_they_mean_to_transformers(tmp_path):
    """No original_max_position_embeddings (-> max_position_embeddings) and mscale_all_dim
    without mscale (cos/sin scaled by mscale(factor), not a ratio)."""
    yarn = dict(rope_type="yarn", factor=4.0, mscale_all_dim=1.0)
    _hf_model(dict(rope=yarn, max_position_embeddings=8192)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("original_max_position_embeddings", "mscale", "beta_fast", "beta_slow"):
        cfg["rope_parameters"].pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    ours = _ours_from_dir(str(tmp_path))
    input_ids = _ids((2, 17), 1)
    position_ids = torch.arange(17) + torch.tensor([[0], [5000]])
    with torch.no_grad():
        expected = hf_model(input_ids, position_ids=position_ids).logits
        torch.testing.assert_close(
            ours(input_ids, position_ids).logits, expected, rtol=1e-4, atol=1e-4
        )


# --- config.json ----------------------------------------------------------------------------


def _published_dialect(v5: dict) -> dict:
    """The transformers-5 config.json `v5` rewritten as the released checkpoints write it."""
    published = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    published["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    published["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    published.update(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=1,  # read as 0: MTP is opt-in
        aux_loss_alpha=0.001,
        seq_aux=True,
        moe_layer_freq=1,
        ep_size=1,
    )
    return published


@pytest.mark.parametrize("case", ["plain_q_group1_shared2_tied", "yarn_no_interleave_shared2"])
def test_both_config_dialects_give_the_same_args(case, tmp_path):
    _hf_model(CASES[case]).save_pretrained(tmp_path)
    v5 = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in v5
    published = _published_dialect(v5)
    args = load_hf_config(str(tmp_path))
    assert args_from_hf_config(published) == args_from_hf_config(v5) == args
    assert args.num_nextn_predict_layers == 0
    if CASES[case].get("q_lora_rank", 16) is None:
        assert published["q_lora_rank"] is None and args.q_lora_rank == 0
    else:
        assert (args.rope_type, args.rope_factor, args.rope_mscale_all_dim) == ("yarn", 4.0, 1.0)
        assert (args.rope_mscale, args.rope_original_max_position_embeddings) == (0.8, 1024)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_published_config_json_matches_the_shipped_config(model):
    """The repo's TOML equals the published config.json read by the adapter, also after
    transformers has rewritten it in its own dialect (rope_scaling -> rope_parameters)."""
    toml_path, published, _ = PUBLISHED[model]
    published = {k: v for k, v in published.items() if k != "quantization_config"}  # as bf16
    ours = load_config(["--config", toml_path]).model.args
    training = {k: getattr(ours, k) for k in SPEC.training_fields}
    from_published = dataclasses.replace(args_from_hf_config(published), **training)
    assert from_published == ours
    rewritten = transformers.DeepseekV3Config.from_dict(published).to_dict()
    assert "rope_parameters" in rewritten
    assert dataclasses.replace(args_from_hf_config(rewritten), **training) == ours


# --- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["plain_q_group1_shared2_tied", "yarn_no_interleave_shared2"])
def test_export_round_trip_reproduces_our_logits_in_transformers(case, tmp_path):
    args = args_from_hf_config(_hf_config(CASES[case]).to_dict())
    ours = _ours(args, seed=3)
    save_hf_checkpoint(ours, SPEC.hf_adapter, args, str(tmp_path))

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert isinstance(reloaded, transformers.DeepseekV3ForCausalLM)
    input_ids = _ids((2, 13), 4)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids).logits, ours(input_ids).logits, rtol=1e-4, atol=1e-4
        )
    exported = load_file(str(tmp_path / "model.safetensors"))
    hf_buffers = dict(reloaded.named_buffers())
    for i in range(args.first_k_dense_replace, args.num_hidden_layers):
        bias = ours.layers[i].mlp.gate.e_score_correction_bias
        key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        assert bias.abs().min() > 0
        assert torch.equal(exported[key], bias) and torch.equal(hf_buffers[key], bias)


@pytest.mark.parametrize("case", ["qlora_group4", "plain_q_group1_shared2_tied"])
def test_mtp_export_and_reimport_reproduce_every_tensor(case, tmp_path):
    args = args_from_hf_config(_hf_config(CASES[case]).to_dict())
    args = dataclasses.replace(args, num_nextn_predict_layers=1)
    ours = _ours(args, seed=5)
    save_hf_checkpoint(ours, SPEC.hf_adapter, args, str(tmp_path))

    # The MTP module is layer L: a decoder block's keys plus its own, as DeepSeek ships it.
    exported = load_file(str(tmp_path / "model.safetensors"))
    L = args.num_hidden_layers

    def layer_keys(i: int) -> set[str]:
        prefix = f"model.layers.{i}."
        return {k.removeprefix(prefix) for k in exported if k.startswith(prefix)}

    mtp_keys, block_keys = layer_keys(L), layer_keys(L - 1)
    own = {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
    }
    assert mtp_keys == block_keys | own and not block_keys & own
    assert not layer_keys(L + 1)
    head = ours.embed_tokens.weight if args.tie_word_embeddings else ours.lm_head.weight
    assert torch.equal(exported[f"model.layers.{L}.shared_head.head.weight"], head)
    assert torch.equal(exported[f"model.layers.{L}.embed_tokens.weight"], ours.embed_tokens.weight)
    assert torch.equal(
        exported[f"model.layers.{L}.shared_head.norm.weight"], ours.mtp[0].norm.weight
    )
    assert torch.equal(exported[f"model.layers.{L}.eh_proj.weight"], ours.mtp[0].eh_proj.weight)

    fresh = _ours_from_dir(str(tmp_path), num_nextn_predict_layers=1)
    theirs = fresh.state_dict()
    assert theirs.keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name], tensor), name

    input_ids, mtp_ids = _ids((2, 11), 6), _ids((2, 11, 1), 7)
    with torch.no_grad():
        want, got = ours(input_ids, mtp_input_ids=mtp_ids), fresh(input_ids, mtp_input_ids=mtp_ids)
        # A model without MTP reads the same export (the MTP layer's keys are skipped).
        no_mtp = _ours_from_dir(str(tmp_path))(input_ids)
    assert len(want.mtp_logits) == 1
    torch.testing.assert_close(got.mtp_logits[0], want.mtp_logits[0], rtol=0, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert no_mtp.mtp_logits is None
    torch.testing.assert_close(no_mtp.logits, want.logits, rtol=0, atol=0)


# --- refusals -------------------------------------------------------------------------------


def test_refuses_what_it_cannot_read(tmp_path):
    bf16 = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    with pytest.raises(HFFormatError, match="scoring_func='softmax'"):
        args_from_hf_config(dict(bf16, scoring_func="softmax"))
    with pytest.raises(HFFormatError, match="num_key_value_heads=16"):
        args_from_hf_config(dict(bf16, num_key_value_heads=16))
    with pytest.raises(HFFormatError, match="model_type"):
        args_from_hf_config(dict(bf16, model_type="qwen3_moe"))
    with pytest.raises(HFFormatError, match="dequantize them to bf16"):
        args_from_hf_config(DEEPSEEK_V3_CONFIG)  # the fp8 release as published

    _hf_model(CASES["qlora_group4"]).save_pretrained(tmp_path)  # no MTP weights saved
    L = BASE["num_hidden_layers"]
    with pytest.raises(HFFormatError, match=rf"no MTP layer model\.layers\.{L} .*=0"):
        _ours_from_dir(str(tmp_path), num_nextn_predict_layers=1)


# --- the published models' configs ----------------------------------------------------------


def _billions(n: int) -> float:
    return n / 1e9


def _about(billions: float):
    return pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_shipped_config_has_the_published_parameter_count(model):
    toml_path, _, published = PUBLISHED[model]
    cfg = load_config(["--config", toml_path])
    args = cfg.model.args
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        net = spec.build(args)
    sizes = {name: p.numel() for name, p in net.named_parameters()}
    total = sum(sizes.values())
    mtp = sum(n for name, n in sizes.items() if name.startswith("mtp."))
    routed = sum(
        n for name, n in sizes.items() if ".experts." in name and name.startswith("layers.")
    )
    embedding = args.vocab_size * args.hidden_size
    # A token goes through top-k of the routed experts and everything else (MTP aside).
    activated = total - mtp - routed + routed * args.num_experts_per_tok // args.n_routed_experts
    # The released MTP layer carries its own copies of embedding and head.
    checkpoint = total + args.num_nextn_predict_layers * 2 * embedding

    assert _billions(checkpoint) == _about(published["checkpoint"])
    if "main" in published:  # DeepSeek-V3
        assert args.num_nextn_predict_layers == 1
        assert _billions(total - mtp) == _about(published["main"])
        assert _billions(activated - embedding) == _about(published["activated_without_embedding"])
    else:  # Moonlight
        assert args.num_nextn_predict_layers == 0
        assert _billions(total - 2 * embedding) == _about(published["non_embedding"])
        assert _billions(activated - 2 * embedding) == _about(published["activated_non_embedding"])
