"""Model pieces against direct, naive implementations; schedules against their formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.build.optimizer import lr_factor
from moetrain.config import TrainSection
from moetrain.models.common.bias_router import BiasedSoftmaxRouter
from moetrain.models.common.grouped_gemm import grouped_mm
from moetrain.models.common.hf_names import Moved, PrefixedStackedNames
from moetrain.models.common.mlp import SwiGLU
from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter
from moetrain.models.common.replay import replay
from moetrain.models.common.rope import apply_rope_interleaved, rope_cos_sin


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


def test_biased_softmax_router_chooses_with_the_bias_and_weights_without_it():
    """The correction bias decides which experts are chosen, never their weights; the
    counts are kept for training forwards only, once (not for eval, no-grad or replays)."""
    torch.manual_seed(0)
    router = BiasedSoftmaxRouter(16, num_experts=6, top_k=2, norm_min=1e-12)
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(10, 16, requires_grad=True)
    probs = F.softmax(x @ router.weight.T, dim=-1)
    router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, 3.0]))
    routing = router(x)
    assert routing.top_experts.sort(-1).values.tolist() == [[4, 5]] * 10  # the bias chose
    chosen = probs.gather(1, routing.top_experts)
    torch.testing.assert_close(routing.top_weights, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.probs, probs)
    # the weights carry the router's gradient; the bias none (a buffer, used detached)
    routing.top_weights[:, 0].sum().backward()
    assert router.weight.grad.abs().sum() > 0
    assert router.tokens_per_expert.tolist() == [0, 0, 0, 0, 10, 10]
    with torch.no_grad():
        router(x)
    with replay():
        router(x)
    router.eval()
    router(x)
    assert router.tokens_per_expert.tolist() == [0, 0, 0, 0, 10, 10]


def test_swiglu_bias_is_optional_and_added_in_each_projection():
    torch.manual_seed(0)
    assert SwiGLU(8, 12).gate_proj.bias is None
    mlp = SwiGLU(8, 12, bias=True)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 8)
    gate = x @ mlp.gate_proj.weight.T + mlp.gate_proj.bias
    up = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    want = (F.silu(gate) * up) @ mlp.down_proj.weight.T + mlp.down_proj.bias
    torch.testing.assert_close(mlp(x), want)


def test_interleaved_rope_gives_the_attention_scores_of_gpt_j_pairs():
    """apply_rope_interleaved returns its dims permuted (evens, then odds), the same for q
    and k, so every q.k equals that of GPT-J's rotation of adjacent pairs in place, which is
    written here directly: pair i of position p turned by the angle p * theta^(-2i / D)."""
    torch.manual_seed(0)
    B, S, H, D, theta = 2, 7, 3, 8, 10000.0
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    positions = torch.arange(S).expand(B, S) + torch.tensor([[0], [50]])
    cos, sin = rope_cos_sin(positions, D, theta, torch.float32)

    def gpt_j(x: torch.Tensor) -> torch.Tensor:
        angle = positions[..., None].float() * theta ** (-torch.arange(0, D, 2) / D)
        pairs = torch.view_as_complex(x.reshape(B, S, H, D // 2, 2).contiguous())
        turned = pairs * torch.polar(torch.ones_like(angle), angle)[:, :, None]
        return torch.view_as_real(turned).reshape(B, S, H, D)

    ours = torch.einsum("bshd,bthd->bhst", apply_rope_interleaved(q, cos, sin),
                        apply_rope_interleaved(k, cos, sin))  # fmt: skip
    want = torch.einsum("bshd,bthd->bhst", gpt_j(q), gpt_j(k))
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    evens_then_odds = torch.cat([gpt_j(q)[..., 0::2], gpt_j(q)[..., 1::2]], dim=-1)
    torch.testing.assert_close(apply_rope_interleaved(q, cos, sin), evens_then_odds)


def test_a_moved_key_changes_module_and_shape_both_ways():
    """`Moved`: native `mlp.gate.b` [E] is `mlp.stats.b` [1, E] in the checkpoint (written
    there, read from there or from its alias); `no_checkpoint` state is neither."""
    names = PrefixedStackedNames(
        expert_width=lambda args: (4, 2),
        tied=lambda args: False,
        moved=(Moved("mlp.gate.b", "mlp.stats.b", leading_ones=1, aliases=("mlp.gate.s.b",)),),
        no_checkpoint=("counts",),
    )
    name, value = "layers.3.mlp.gate.b", torch.arange(4.0)
    assert names.hf_keys(name, (4,), None, lambda key: False) == {
        "model.layers.3.mlp.stats.b": (1, 4)
    }
    written = names.to_hf(name, value, None)
    assert list(written) == ["model.layers.3.mlp.stats.b"] and written[
        "model.layers.3.mlp.stats.b"
    ].shape == (1, 4)
    for key in ("model.layers.3.mlp.stats.b", "model.layers.3.mlp.gate.s.b"):
        stored = {key: value[None]}

        def get(k, index, stored=stored):
            return stored[k][index]

        assert names.hf_keys(name, (4,), None, stored.__contains__) == {key: (1, 4)}
        part = names.from_hf(name, None, stored.__contains__, get, (slice(1, 3),))
        assert part.tolist() == [1.0, 2.0]
    assert names.hf_keys("layers.3.mlp.gate.counts", (4,), None, lambda key: True) == {}
    assert names.to_hf("layers.3.mlp.gate.counts", value, None) == {}


def test_routed_sum_keeps_only_the_index_and_gives_index_add_gradients():
    """Unpermute's sum of each token's routed rows (moetrain/models/common/row_sum.py): the same
    output and row gradients as autograd's index_add_, bit for bit, while what its backward
    keeps is the index alone (index_add_ keeps the [N, dim] rows as well)."""
    from torch.autograd.graph import saved_tensors_hooks

    from moetrain.models.common.moe import Unpermute

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 6, generator=g, requires_grad=True)
    token_of = torch.randint(0, 5, (12,), generator=g)
    upstream = torch.randn(5, 6, generator=g)

    def run(fn) -> tuple[torch.Tensor, torch.Tensor, int]:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            out = fn(rows * 2.0, token_of, 5)  # rows * 2: a non-leaf, as the experts' output
        (grad,) = torch.autograd.grad(out, rows, upstream)
        return out, grad, sum(saved.values())

    plain = lambda r, i, t: r.new_zeros(t, r.shape[1]).index_add_(0, i, r)  # noqa: E731
    ours, reference = run(Unpermute()), run(plain)
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    index_bytes = token_of.numel() * token_of.element_size()
    assert ours[2] == index_bytes
    assert reference[2] == index_bytes + rows.numel() * rows.element_size()
