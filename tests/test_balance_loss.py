"""The routers' losses on their own: the aux loss per layer (the default) against a plain
loop over layers, the pooled option against transformers, the gradient each gives a layer
whose routing mirrors another's, and the z-loss against its definition. (Every layout
against one process, with both options and the z-loss: tests/test_layout_parity.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.models.common.balance_losses import (
    load_balancing_loss,
    sequence_balance_loss,
    stack_stats,
    z_loss_sum,
)
from moetrain.models.common.moe import MoE, RouterStats, TopKRouter


def _stats_from_logits(logits: torch.Tensor, top_k: int) -> RouterStats:
    """RouterStats of softmax routing from logits [L, B, S, E], written out here."""
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices  # [L, B, S, k]
    counts = F.one_hot(chosen, logits.shape[-1]).sum((2, 3)).float()  # [L, B, E]
    z_sum = torch.logsumexp(logits, -1).square().sum(-1)  # [L, B]
    return RouterStats(counts, probs.sum(2), z_sum, logits.shape[2], top_k)


def _random_stats(layers=3, batch=2, seq=10, experts=6, top_k=2, seed=0) -> RouterStats:
    g = torch.Generator().manual_seed(seed)
    return _stats_from_logits(torch.randn(layers, batch, seq, experts, generator=g), top_k)


def test_per_layer_loss_is_the_mean_of_each_layers_switch_loss():
    stats = _random_stats()
    L, B, E = stats.prob_sum.shape
    T = B * stats.seq_len
    expected = 0.0
    for layer in range(L):  # Switch: E * sum_e f_e P_e on this layer's tokens alone
        f = [stats.tokens_per_expert[layer, :, e].sum().item() / T for e in range(E)]
        p = [stats.prob_sum[layer, :, e].sum().item() / T for e in range(E)]
        expected += E * sum(fe * pe for fe, pe in zip(f, p)) / L
    assert load_balancing_loss(stats, E).item() == pytest.approx(expected, rel=1e-6)

    # Two "ranks" holding half the sequences each: with the counts over both, their
    # shares add up to the whole batch's value.
    halves = [RouterStats(*(t[:, i : i + 1] for t in stats[:3]), *stats[3:]) for i in range(B)]
    counts = stats.tokens_per_expert.sum(1)  # [L, E] over the "ranks"
    shares = sum(load_balancing_loss(h, E, counts, T) for h in halves)
    assert shares.item() == pytest.approx(expected, rel=1e-6)


def test_pooled_loss_equals_transformers():
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers, tokens, experts, top_k = 3, 12, 6, 2
    logits = torch.randn(layers, 1, tokens, experts, generator=torch.Generator().manual_seed(1))
    stats = _stats_from_logits(logits, top_k)
    theirs = load_balancing_loss_func(tuple(logits[:, 0]), experts, top_k)
    assert transformers.__version__  # the function above is theirs, not a copy
    ours = load_balancing_loss(stats, experts, pooled=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # The per-layer value is another number on the same statistics.
    assert abs(load_balancing_loss(stats, experts).item() - ours.item()) > 1e-3


def test_sequence_loss_per_layer_and_pooled_against_plain_loops():
    stats = _random_stats(seed=2)
    L, B, E = stats.prob_sum.shape
    T, K = stats.seq_len, stats.top_k
    per_layer = pooled = 0.0
    for b in range(B):  # DeepSeek-V3: f = E / (K T) * count, P = mean affinity
        for layer in range(L):
            f = stats.tokens_per_expert[layer, b] * E / (K * T)
            per_layer += (f * stats.prob_sum[layer, b] / T).sum().item() / L
        f = stats.tokens_per_expert[:, b].sum(0) * E / (K * T * L)
        pooled += (f * stats.prob_sum[:, b].sum(0) / (T * L)).sum().item()
    assert sequence_balance_loss(stats).item() == pytest.approx(per_layer, rel=1e-6)
    assert sequence_balance_loss(stats, pooled=True).item() == pytest.approx(pooled, rel=1e-6)


def _mirror_layers() -> list[MoE]:
    """Two MoE layers over 2 features and 4 experts, top-1: layer 0 sends 3 of 4 tokens to
    expert 0 and 1 to expert 1; layer 1 mirrors it (3 to expert 1, 1 to expert 0)."""
    layers = []
    for overloaded, idle in ((0, 1), (1, 0)):
        router = TopKRouter(2, 4, 1, norm_topk_prob=False)
        weight = torch.full((4, 2), -20.0)
        weight[overloaded] = torch.tensor([2.0, 0.0])
        weight[idle] = torch.tensor([0.0, 2.0])
        with torch.no_grad():
            router.weight.copy_(weight)
        moe = MoE(2, 4, router)
        for p in moe.experts.parameters():
            torch.nn.init.normal_(p, std=0.1)
        layers.append(moe)
    return layers


# Tokens [1, 4, 2]: three lean to feature 0, one to feature 1.
_TOKENS = torch.tensor([[[1.0, 0.1], [0.9, 0.2], [1.1, 0.0], [0.1, 1.0]]])


@pytest.mark.parametrize("pooled", [False, True], ids=["per_layer", "pooled"])
def test_mirror_image_layers_each_layer_pushes_down_its_own_overloaded_expert(pooled):
    layers = _mirror_layers()
    logits = []
    for moe in layers:  # the routers' logits, to read the loss's pull on each expert
        moe.gate.register_forward_hook(lambda _m, _i, out: logits.append(out.logits))
    stats = []
    for moe in layers:
        _, s = moe(_TOKENS)
        stats.append(s)
    stats = stack_stats(stats)
    assert stats.tokens_per_expert[:, 0].tolist() == [[3, 1, 0, 0], [1, 3, 0, 0]]
    for lg in logits:
        lg.retain_grad()
    probs = stats.prob_sum
    probs.retain_grad()
    load_balancing_loss(stats, num_experts=4, pooled=pooled).backward()

    for layer, (over, idle) in enumerate(((0, 1), (1, 0))):
        g = probs.grad[layer, 0]  # d loss / d (affinity sum of each expert)
        ratio = (g[over] / g[idle]).item()
        pull = logits[layer].grad.sum(0)  # descent lowers the logits where this is > 0
        if pooled:
            # Pooled counts are 4 and 4: the layer's overload is invisible, the same
            # gradient on its busy and its idle expert, and no pull on the logits at all.
            assert ratio == pytest.approx(1.0, rel=1e-6)
            assert pull[[over, idle]].abs().max() < 1e-6
        else:
            assert ratio == pytest.approx(3.0, rel=1e-6)  # the layer's own counts, 3 : 1
            assert pull[over] > 1e-3 and pull[idle] < -1e-3


def test_z_loss_is_the_mean_over_tokens_and_layers_of_logsumexp_squared():
    torch.manual_seed(3)
    layers = [MoE(8, 4, TopKRouter(8, 5, 2, norm_topk_prob=True)) for _ in range(3)]
    for moe in layers:
        torch.nn.init.normal_(moe.gate.weight, std=1.0)
    x = torch.randn(2, 7, 8)
    stats = stack_stats([moe(x)[1] for moe in layers])
    expected = 0.0
    for moe in layers:  # ST-MoE: (1/T) sum_t (log sum_e exp(x_t . w_e))^2, per layer
        for token in x.reshape(-1, 8):
            lse = torch.log(torch.exp(moe.gate.weight @ token).sum())
            expected += lse.item() ** 2 / (x.shape[0] * x.shape[1] * len(layers))
    assert (z_loss_sum(stats) / (2 * 7)).item() == pytest.approx(expected, rel=1e-5)
    assert expected > 1.0  # logits of std ~3: the z-loss is not a vanishing number here
