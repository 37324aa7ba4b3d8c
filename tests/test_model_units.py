"""Model pieces against direct, naive implementations; schedules against their formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.common.moe import MoE, MoEOptions, TopKRouter, grouped_mm
from trainer.config import TrainSection
from trainer.loop.optim import lr_factor


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [0, 0, 0, 0]])
def test_grouped_mm_matches_per_expert_matmul(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    tpe = torch.tensor(counts)
    ref = torch.cat([x[sum(counts[:e]) : sum(counts[: e + 1])] @ w[e] for e in range(4)])
    for impl in ("grouped_mm", "loop"):
        out = grouped_mm(x, w, tpe, impl)
        torch.testing.assert_close(out, ref)
        grad_out = torch.randn(out.shape, generator=g)
        gx, gw = torch.autograd.grad(out, (x, w), grad_out)
        rx, rw = torch.autograd.grad(ref, (x, w), grad_out, retain_graph=True)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("chunks", [1, 2, 3])  # 3: pieces of 4, 3 and 3 tokens
def test_moe_matches_token_by_token_reference(chunks):
    torch.manual_seed(0)
    router = TopKRouter(16, num_experts=6, top_k=2, norm_topk_prob=True)
    moe = MoE(dim=16, hidden_dim=8, router=router, options=MoEOptions(chunks=chunks))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    y, stats = moe(x)
    if chunks > 1:  # the gradients too, against the layer in one piece
        whole = MoE(16, 8, TopKRouter(16, num_experts=6, top_k=2, norm_topk_prob=True))
        whole.load_state_dict(moe.state_dict())
        y.square().sum().backward()
        whole(x)[0].square().sum().backward()
        for (name, p), q in zip(moe.named_parameters(), whole.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)

    ref = torch.zeros_like(x).reshape(-1, 16)
    probs = F.softmax(x.reshape(-1, 16) @ moe.gate.weight.T, dim=-1)
    for t, token in enumerate(x.reshape(-1, 16)):
        weights, experts = probs[t].topk(2)
        weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate_up = moe.experts.gate_up_proj[e] @ token
            gate, up = gate_up.chunk(2)
            ref[t] += w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(y.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)
    assert stats.tokens_per_expert.sum() == 10 * 2
    torch.testing.assert_close(stats.prob_sum, probs.view(2, 5, 6).sum(1))  # per sequence


def _cfg(**kw) -> TrainSection:
    return TrainSection(**{"steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1, **kw})


def test_warmup_then_cosine():
    cfg = _cfg(schedule="cosine")
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    mid = 10 + (100 - 10 - 1) / 2
    assert lr_factor(int(mid), cfg) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89))
    )
    assert lr_factor(99, cfg) == pytest.approx(0.1)


def test_warmup_stable_decay():
    cfg = _cfg(schedule="wsd", decay_ratio=0.2)
    assert lr_factor(50, cfg) == 1.0 and lr_factor(79, cfg) == 1.0
    assert lr_factor(80, cfg) == pytest.approx(1 - 0.9 / 20)
    assert lr_factor(99, cfg) == pytest.approx(0.1)
    assert all(lr_factor(s, cfg) >= lr_factor(s + 1, cfg) for s in range(80, 99))


@pytest.mark.parametrize("chunks", [1, 2])  # the whole batch's capacity, then the pieces
def test_capacity_factor_drops_late_assignments_gshard_style(chunks):
    torch.manual_seed(0)
    options = MoEOptions(capacity_factor=0.5, gemm="loop", chunks=chunks)
    moe = MoE(16, 8, TopKRouter(16, 4, 2, norm_topk_prob=False), options)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 12, 16)
    y, _ = moe(x)

    capacity = math.ceil(0.5 * 12 * 2 / 4)  # 3 assignments per expert
    probs = F.softmax(x[0] @ moe.gate.weight.T, dim=-1)
    weights, experts = probs.topk(2)
    ref, kept = torch.zeros(12, 16), [0] * 4
    for t in range(12):  # token order decides who is dropped
        for w, e in zip(weights[t], experts[t].tolist()):
            if kept[e] == capacity:
                continue
            kept[e] += 1
            gate, up = (moe.experts.gate_up_proj[e] @ x[0, t]).chunk(2)
            ref[t] += w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
    assert sum(kept) < 24, "the test must actually drop something"
    torch.testing.assert_close(y[0], ref, rtol=1e-5, atol=1e-6)


def test_warmup_longer_than_the_run_is_clamped_to_it():
    cfg = _cfg(steps=4, warmup_steps=10, schedule="constant")
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
