"""What only DeepSeek-V3 has, beside the model suite (tests/test_models.py and its siblings,
which cover its parity with transformers, export, config.json, refusals and layouts from
tests/families/deepseek_v3.py): its pooled aux loss (transformers computes none), YaRN keys
a config.json leaves out, what the released files' own keys read as, MTP export and
reimport, and the shipped configs of the published models (DeepSeek-V3, Moonlight)."""

import copy
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from safetensors.torch import load_file  # noqa: E402

from moetrain.config import load_config  # noqa: E402
from moetrain.hf.weights import save_hf_checkpoint  # noqa: E402
from moetrain.models import get_model_spec  # noqa: E402
from moetrain.models.common.balance_losses import load_balancing_loss  # noqa: E402
from moetrain.models.deepseek_v3.args import DeepseekV3Args  # noqa: E402
from moetrain.models.deepseek_v3.hf import HFFormatError, args_from_hf_config, load_hf_config  # noqa: E402
from tests.families.deepseek_v3 import DATA, DEEPSEEK_V3_CONFIG, FAMILY  # noqa: E402
from tests.families.models import (  # noqa: E402
    hf_config,
    native_args,
    native_model,
    ours_from_dir,
    perturb,
    published_dialect,
    spec_of,
    token_ids,
)

SPEC = spec_of(FAMILY)
CASES = FAMILY.cases
BASE = FAMILY.base
# The published config.json files (tests/families/deepseek_v3.py); Moonlight's has no
# rope_scaling; `q_lora_rank: null` means a plain q_proj.
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


def _hf_model(overrides: dict, seed: int = 0):
    cfg = hf_config(transformers, FAMILY, overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    perturb(FAMILY, model, seed + 1)
    return model


def _ours(args: DeepseekV3Args, seed: int):
    return native_model(FAMILY, args, seed).eval()


def _ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return token_ids(FAMILY, shape, seed)


# --- parity with transformers ---------------------------------------------------------------


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
    ours = ours_from_dir(FAMILY, tmp_path)
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
    ours = ours_from_dir(FAMILY, tmp_path)
    input_ids = _ids((2, 17), 1)
    position_ids = torch.arange(17) + torch.tensor([[0], [5000]])
    with torch.no_grad():
        expected = hf_model(input_ids, position_ids=position_ids).logits
        torch.testing.assert_close(
            ours(input_ids, position_ids).logits, expected, rtol=1e-4, atol=1e-4
        )


# --- config.json ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["plain_q_group1_shared2_tied", "yarn_no_interleave_shared2"])
def test_mtp_is_opt_in_and_a_null_q_lora_rank_is_a_plain_q_proj(case, tmp_path):
    """Beside the suite's dialect test: what the released files' own keys read as."""
    hf_config(transformers, FAMILY, CASES[case]).save_pretrained(tmp_path)
    published = published_dialect(FAMILY, json.loads((tmp_path / "config.json").read_text()))
    args = args_from_hf_config(published)
    assert published["num_nextn_predict_layers"] == 1 and args.num_nextn_predict_layers == 0
    if CASES[case].get("q_lora_rank", 16) is None:
        assert published["q_lora_rank"] is None and args.q_lora_rank == 0
    else:
        assert (args.rope_type, args.rope_factor, args.rope_mscale_all_dim) == ("yarn", 4.0, 1.0)
        assert (args.rope_mscale, args.rope_original_max_position_embeddings) == (0.8, 1024)
    assert args == load_hf_config(str(tmp_path))


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
    # NOTE: a deep copy: transformers rewrites the nested rope_scaling it is given in place,
    # and the dict is shared with the family's table (tests/families/deepseek_v3.py).
    rewritten = transformers.DeepseekV3Config.from_dict(copy.deepcopy(published)).to_dict()
    assert "rope_parameters" in rewritten
    assert dataclasses.replace(args_from_hf_config(rewritten), **training) == ours


# --- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["qlora_group4", "plain_q_group1_shared2_tied"])
def test_mtp_export_and_reimport_reproduce_every_tensor(case, tmp_path):
    args = native_args(FAMILY, case)
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

    fresh = ours_from_dir(FAMILY, tmp_path, num_nextn_predict_layers=1)
    theirs = fresh.state_dict()
    assert theirs.keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name], tensor), name

    input_ids, mtp_ids = _ids((2, 11), 6), _ids((2, 11, 1), 7)
    with torch.no_grad():
        want, got = ours(input_ids, mtp_input_ids=mtp_ids), fresh(input_ids, mtp_input_ids=mtp_ids)
        # A model without MTP reads the same export (the MTP layer's keys are skipped).
        no_mtp = ours_from_dir(FAMILY, tmp_path)(input_ids)
    assert len(want.mtp_logits) == 1
    torch.testing.assert_close(got.mtp_logits[0], want.mtp_logits[0], rtol=0, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert no_mtp.mtp_logits is None
    torch.testing.assert_close(no_mtp.logits, want.logits, rtol=0, atol=0)


# --- refusals -------------------------------------------------------------------------------


def test_a_missing_mtp_layer_is_refused_naming_the_fix(tmp_path):
    _hf_model(CASES["qlora_group4"]).save_pretrained(tmp_path)  # no MTP weights saved
    L = BASE["num_hidden_layers"]
    with pytest.raises(HFFormatError, match=rf"no MTP layer model\.layers\.{L} .*=0"):
        ours_from_dir(FAMILY, tmp_path, num_nextn_predict_layers=1)


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
