"""The update's pieces in one process on plain tensors: the gradient norm and clipping
(`moetrain/parallelisms/clip.py`, foreach ops) against a plain reference, fused AdamW against
foreach (`train.optimizer_impl`), and a checkpoint of one resumed by the other. The
sharded and multi-mesh cases: tests/test_layout_parity.py (every row fused against a
foreach reference) and tests/test_checkpoint.py (foreach saved, fused resumed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moetrain.build.optimizer import build_optimizer, fused_unsupported, optimizer_impl
from moetrain.checkpoint.checkpointer import _OPTIONS, Checkpointer, _state
from moetrain.config import TrainSection
from moetrain.parallelisms.clip import clip_grads_, grad_norm


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 5, bias=False))


def _backward(model: nn.Module, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().mul(50).backward()


def test_norm_and_clip_equal_a_plain_reference():
    grads = [torch.randn(7, 5), torch.randn(0), torch.randn(33).bfloat16(), torch.randn(3, 3)]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads] + [nn.Parameter(torch.ones(2))]
    for p, g in zip(params, grads, strict=False):
        p.grad = g.clone()  # the last parameter has no gradient: not counted, not touched
    ref = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
    norm = grad_norm(params)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    clip_grads_(params, 0.5, norm)
    scale = 0.5 / (ref + 1e-6)
    for p, g in zip(params, grads, strict=False):
        torch.testing.assert_close(p.grad, (g.float() * scale).to(g.dtype), rtol=1e-6, atol=0)
    assert params[-1].grad is None
    clipped = [p.grad.clone() for p in params[:-1]]
    clip_grads_(params, 0.0, norm)  # 0: off
    clip_grads_(params, 1e9, grad_norm(params))  # under max_norm: the scale is 1
    assert all(torch.equal(p.grad, c) for p, c in zip(params, clipped, strict=False))
    # No gradient anywhere (a pipeline stage that trains nothing): zero, on `device`.
    assert grad_norm([params[-1]], device=torch.device("cpu")).item() == 0.0


def _train(impl: str, steps: int, model: nn.Module | None = None, opt=None):
    cfg = replace(TrainSection(), optimizer_impl=impl, weight_decay=0.1)
    model = model or _model()
    opt = opt or build_optimizer(model, cfg)
    for step in range(steps):
        _backward(model, step)
        clip_grads_(list(model.parameters()), 1.0, grad_norm(model.parameters()), opt)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_fused_agrees_with_foreach_within_fp32_rounding():
    fused, opt = _train("fused", 5)
    assert optimizer_impl(opt) == "fused" and opt.param_groups[0]["fused"]
    foreach, opt = _train("foreach", 5)
    assert optimizer_impl(opt) == "foreach"
    for a, b in zip(fused.parameters(), foreach.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.5, 1e9], ids=["clipping", "under_the_limit"])
def test_fused_adamw_clips_inside_its_update_as_the_separate_pass_does(max_norm):
    """Given the fused optimizer, `clip_grads_` leaves the gradients to its kernel (its
    `grad_scale`): the update and the gradients it writes back are those of clipping first
    and stepping after, within fp32 rounding, and bit for bit when nothing is clipped."""
    cfg = replace(TrainSection(), optimizer_impl="fused", weight_decay=0.1, lr=1e-2)
    sides = []
    for inside in (True, False):
        model = _model()
        opt = build_optimizer(model, cfg)
        _backward(model, 0)
        params = list(model.parameters())
        norm = grad_norm(params)
        raw = [p.grad.clone() for p in params]
        clip_grads_(params, max_norm, norm, opt if inside else None)
        if inside:  # nothing touched yet: the kernel clips
            assert all(torch.equal(p.grad, g) for p, g in zip(params, raw, strict=True))
        opt.step()
        sides.append(([p.detach().clone() for p in params], [p.grad for p in params]))
    (params_in, grads_in), (params_out, grads_out) = sides
    assert norm > 0.5  # so that 0.5 clips
    for a, b in zip(params_in + grads_in, params_out + grads_out, strict=True):
        if max_norm > norm:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_falls_back_to_foreach_where_torch_has_none():
    model = _model()
    assert fused_unsupported(list(model.parameters())) is None
    assert fused_unsupported(list(model.parameters()), "mps") == "torch.float32 on mps"
    opt = build_optimizer(model, TrainSection(), device="mps")
    assert optimizer_impl(opt) == "foreach"


@pytest.mark.parametrize("saved,resumed", [("foreach", "fused"), ("fused", "foreach")])
def test_checkpoint_resumes_across_implementations(saved, resumed, tmp_path):
    """Saved after 2 steps by one, resumed by the other for 2 more: its own kernels (not
    the saved param groups'), and the 4 steps of an uninterrupted run within rounding."""
    model, opt = _train(saved, 2)
    dcp.save(_state(model, opt, _OPTIONS), checkpoint_id=str(tmp_path))
    fresh = _model(seed=1)
    fresh_opt = build_optimizer(fresh, replace(TrainSection(), optimizer_impl=resumed))
    Checkpointer.load_weights(str(tmp_path), fresh, fresh_opt)
    assert optimizer_impl(fresh_opt) == resumed
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
        assert fresh_opt.state[q]["step"].item() == 2
    for step in (2, 3):  # the next batches of the uninterrupted run
        _backward(fresh, step)
        clip_grads_(list(fresh.parameters()), 1.0, grad_norm(fresh.parameters()), fresh_opt)
        fresh_opt.step()
        fresh_opt.zero_grad()
    straight, _ = _train(saved, 4)
    for a, b in zip(fresh.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --- train.optimizer_state_dtype=bf16 ------------------------------------------------------

BF16 = replace(TrainSection(), optimizer_state_dtype="bf16", weight_decay=0.1, lr=1e-2)


def test_bf16_moments_stay_within_their_rounding_of_exact_adamw():
    """The same gradients, 20 steps, against AdamW in float64. The bf16 state adds one
    rounding (relative u = 2^-8) to each stored moment per step; propagated to first order
    (a moment's error decays by its beta and gains u |moment| each step; the update
    lr/bc1 * m / (sqrt(v/bc2) + eps) moves by its derivatives times them) it bounds every
    parameter's distance from the exact one. Twice that bound holds; and the distance is
    real (the state is bf16, the run differs from fp32 state's)."""
    u, steps = 2.0**-8, 20
    b1, b2, eps, lr, wd = BF16.beta1, BF16.beta2, BF16.eps, BF16.lr, BF16.weight_decay
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 32, generator=gen)
    grads = [torch.randn(64, 32, generator=gen) for _ in range(steps)]
    runs = {}
    for dtype in ("bf16", "fp32"):
        p = nn.Parameter(start.clone())
        opt = build_optimizer(nn.ParameterList([p]), replace(BF16, optimizer_state_dtype=dtype))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        runs[dtype] = (p.detach(), opt.state[p], optimizer_impl(opt))
    bf16, fp32 = runs["bf16"][1], runs["fp32"][1]
    assert bf16["exp_avg"].dtype == torch.bfloat16 == bf16["exp_avg_sq"].dtype
    assert fp32["exp_avg"].dtype == torch.float32 and runs["bf16"][2] == "per-parameter"
    p, m, v = start.double(), torch.zeros_like(start.double()), torch.zeros_like(start.double())
    err_m, err_v, err_p = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        root = (v / bc2).sqrt()
        d = root + eps
        pre_m, pre_v = b1 * err_m, b2 * err_v  # what the widened moments carry into step t
        slip = lr / bc1 * (pre_m / d + m.abs() * (pre_v / bc2) / (2 * root * d * d))
        err_p = (1 - lr * wd) * err_p + slip
        err_m, err_v = pre_m + u * m.abs(), pre_v + u * v
        p = p * (1 - lr * wd) - lr / bc1 * m / d
    gap = (runs["bf16"][0].double() - p).abs()
    # the fp32 arithmetic of either run: a few roundings (2^-24) of the parameter per step
    fp32_noise = steps * 8 * 2.0**-24 * p.abs()
    assert (gap <= 2 * err_p + fp32_noise).all(), (gap - 2 * err_p).max()
    assert ((runs["fp32"][0].double() - p).abs() <= fp32_noise).all()
    assert (gap > 10 * fp32_noise).any()  # the rounding is there


def _steps(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        _backward(model, step)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved", ["bf16", "fp32"])
def test_bf16_state_resumes_bit_exact_and_casts_an_fp32_checkpoint(saved, tmp_path):
    """A bf16-state checkpoint resumes into a bf16-state run bit for bit (2 + 2 steps equal
    4). Changing the dtype across a resume converts: an fp32 checkpoint's moments load as
    their bf16 rounding (and a bf16 one's into an fp32 run exactly)."""
    model = _model()
    opt = build_optimizer(model, replace(BF16, optimizer_state_dtype=saved))
    _steps(model, opt, range(2))
    dcp.save(_state(model, opt, _OPTIONS), checkpoint_id=str(tmp_path))
    fresh = _model(seed=1)
    fresh_opt = build_optimizer(fresh, BF16)
    Checkpointer.load_weights(str(tmp_path), fresh, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q) and fresh_opt.state[q]["step"].item() == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh_opt.state[q][key].dtype == torch.bfloat16
            assert torch.equal(fresh_opt.state[q][key], opt.state[p][key].bfloat16())
    if saved == "fp32":
        return
    _steps(fresh, fresh_opt, range(2, 4))
    straight = _model()
    _steps(straight, build_optimizer(straight, BF16), range(4))
    for a, b in zip(fresh.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
