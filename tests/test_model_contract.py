"""The model contract where it is data rather than code (`moetrain/models/spec.py`): routers take
part in the aux-loss-free bias update by the buffers they hold, whatever their class; a
config.json without `rope_theta` reads as transformers reads it; `loss_terms` and
`flops_per_token` are derived from the args fields a spec names."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moetrain.loop.balance import attach_bias_update, bias_routers
from moetrain.models import get_model_spec, model_names
from moetrain.models.common.flops import active_params
from moetrain.models.common.moe import MoE, Routing
from moetrain.models.common.replay import is_replay
from moetrain.models.spec import AttentionShape, BiasBuffers, ModelSpec


class SelectionBiasRouter(nn.Module):
    """A softmax router written here, outside `moetrain/models/common`, with no base class of the
    trainer's: the experts are chosen by the probabilities plus a bias, weighted by the
    probabilities alone (ERNIE-4.5's routing). It registers the bias and the counts under
    the names it is given."""

    def __init__(self, dim: int, num_experts: int, top_k: int, names: BiasBuffers) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.names = num_experts, top_k, names
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer(names.bias, torch.zeros(num_experts))
        self.register_buffer(names.counts, torch.zeros(num_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        probs = logits.softmax(-1)
        bias = getattr(self, self.names.bias)
        top_experts = (probs + bias).detach().topk(self.top_k, dim=-1).indices
        if self.training and torch.is_grad_enabled() and not is_replay():
            chosen = top_experts.flatten()
            getattr(self, self.names.counts).index_add_(0, chosen, torch.ones_like(chosen))
        return Routing(probs, probs.gather(1, top_experts), top_experts, logits)


CUSTOM = BiasBuffers(bias="selection_bias", counts="assignments")


@pytest.mark.parametrize("names", [BiasBuffers(), CUSTOM], ids=["default_names", "custom"])
def test_a_router_of_its_own_class_has_its_bias_moved_by_the_optimizer_hook(names):
    """The update is found through the spec's buffer names alone and runs as the real
    AdamW's pre-step hook: the bias moves by rate * sign(mean load - load) of the counts
    the training forward left, and the counts are cleared."""
    g = torch.Generator().manual_seed(0)
    router = SelectionBiasRouter(16, num_experts=4, top_k=2, names=names)
    model = MoE(dim=16, hidden_dim=8, router=router)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        router.weight[0] += 1.0  # expert 0 leans high on the tokens below: unequal loads
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    update = attach_bias_update(model, optimizer, rate=0.01, buffers=names)
    assert update is not None and update.routers == [router]
    if names is CUSTOM:  # other names: found only through the names given
        assert attach_bias_update(model, None, rate=0.01) is None

    x = torch.randn(2, 24, 16, generator=g) + 0.5
    y, _ = model.train()(x)
    y.square().mean().backward()
    load = getattr(router, names.counts).clone()
    assert load.sum() == 2 * 24 * 2 and len(set(load.tolist())) > 1
    optimizer.step()

    want = (0.01 * torch.sign(load.double().mean() - load.double())).float()
    assert torch.equal(getattr(router, names.bias), want)
    assert getattr(router, names.counts).sum() == 0


def test_a_module_with_the_bias_but_not_the_counts_is_refused_naming_both():
    router = nn.Module()
    router.register_buffer("e_score_correction_bias", torch.zeros(4))
    with pytest.raises(ValueError, match="e_score_correction_bias but not tokens_per_expert"):
        bias_routers(nn.ModuleDict({"gate": router}))


def test_deepseek_routers_are_found_by_their_buffers():
    spec = get_model_spec("deepseek_v3")
    args = spec.args_cls(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = spec.build(args)
    gates = [m.gate for m in model.modules() if isinstance(m, MoE)]
    assert len(gates) == 3 and bias_routers(model, spec.bias_buffers) == gates  # 2 + MTP's


# --- rope_theta missing from config.json ----------------------------------------------------


def _without_rope_theta(cfg: dict) -> dict:
    cfg = {k: v for k, v in cfg.items() if k != "rope_theta"}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            cfg[key] = {k: v for k, v in cfg[key].items() if k != "rope_theta"}
    return cfg


@pytest.mark.parametrize("name", model_names())
def test_a_missing_rope_theta_reads_as_transformers_default_for_the_model_type(name, tmp_path):
    """Each model's published config.json, written by its own export, without `rope_theta`:
    our reader and transformers' agree on the theta (transformers' `default_theta` of the
    model type's config class: 10,000 for most, 1e6 for Mixtral, 150,000 for GPT-OSS)."""
    transformers = pytest.importorskip("transformers")
    spec = get_model_spec(name)
    cfg = _without_rope_theta(spec.hf_adapter.hf_config_dict(spec.args_cls()))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = spec.hf_adapter.load_hf_config(str(tmp_path)).rope_theta
    assert ours == theirs.rope_parameters["rope_theta"] == type(theirs).default_theta


# --- loss terms and FLOPs derived from the args --------------------------------------------


def test_a_spec_without_loss_terms_or_flops_derives_both_from_the_args_fields():
    qwen = get_model_spec("qwen3_moe")
    spec = ModelSpec(qwen.name, qwen.args_cls, qwen.model_cls, qwen.plan)
    args = qwen.args_cls(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, router_aux_loss_coef=0.023,
    )  # fmt: skip
    model = spec.build(args)
    assert spec.loss_terms(args).aux_loss_coef == 0.023
    # 6 x the active parameters (embedding left out: untied) + the attention's scores and
    # their use, 6 * layers * heads * (qk + v) * seq.
    want = 6 * active_params(model, model.embed_tokens) + 6 * 3 * 4 * (8 + 8) * 64
    assert spec.flops_per_token(model, 64) == pytest.approx(want, rel=1e-12)

    # Another field names them: the derived defaults follow (also through a replace).
    other = dataclasses.replace(
        spec,
        aux_loss_field=None,
        attention=AttentionShape(layers=lambda a, seq: 1.5, qk_dim="hidden_size"),
    )
    assert other.loss_terms(args).aux_loss_coef == 0.0
    want = 6 * active_params(model, model.embed_tokens) + 6 * 1.5 * 4 * (32 + 8) * 64
    assert other.flops_per_token(model, 64) == pytest.approx(want, rel=1e-12)
