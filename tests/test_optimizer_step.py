"""The update's pieces in one process on plain tensors: the gradient norm and clipping
(`parallelisms/clip.py`, foreach ops) against a plain reference, fused AdamW against
foreach (`train.optimizer_impl`), and a checkpoint of one resumed by the other. The
sharded and multi-mesh cases: tests/test_layout_parity.py (every row fused against a
foreach reference) and tests/test_checkpoint.py (foreach saved, fused resumed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from parallelisms.clip import clip_grads_, grad_norm
from trainer.checkpoint.checkpointer import _OPTIONS, Checkpointer, _state
from trainer.config import TrainSection
from trainer.loop.optim import build_optimizer, fused_unsupported, optimizer_impl


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
        clip_grads_(list(model.parameters()), 1.0, grad_norm(model.parameters()))
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
        clip_grads_(list(fresh.parameters()), 1.0, grad_norm(fresh.parameters()))
        fresh_opt.step()
        fresh_opt.zero_grad()
    straight, _ = _train(saved, 4)
    for a, b in zip(fresh.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
