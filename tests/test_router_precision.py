"""Routers compute in fp32 from a bf16 input and keep that input, not an fp32 copy of it,
for backward (moetrain/models/common/fp32_linear.py; FSDP's fp32 router units do not cast inputs).

Checked against autograd's own cast-then-linear, bit for bit, and in a real bf16 step on an
FSDP rank: every router receives bf16 and nothing of the width of its input is kept in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.models.common.fp32_linear import fp32_linear
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, build_trainer


def _run(fn, leaves: list[torch.Tensor], grad: torch.Tensor):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, torch.autograd.grad(out, leaves, grad), saved


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_is_autograds_cast_and_linear_keeping_the_bf16_input(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(8, 32, generator=g).requires_grad_()
    b = torch.randn(8, generator=g).requires_grad_() if bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    grad = torch.randn(64, 8, generator=g)
    out, grads, saved = _run(lambda: fp32_linear(x, w, b), leaves, grad)
    ref_b = None if b is None else b.float()
    ref, ref_grads, ref_saved = _run(lambda: F.linear(x.float(), w.float(), ref_b), leaves, grad)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    # What backward keeps: the bf16 input itself and the weight; autograd kept an fp32 copy.
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bfloat16, x.shape), (w.dtype, w.shape)]
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in ref_saved)


def _router_worker(rank: int, world: int, argv: list[str], out: str) -> None:
    _, trainer = build_trainer([*argv, "--train.mixed_precision=bf16"], world)
    routers = [m for n, m in trainer.model.named_modules() if n.endswith("mlp.gate")]
    seen, saved = [], []

    def before(module, args) -> None:
        seen.append((args[0].dtype, tuple(args[0].shape)))

    hooks = [r.register_forward_pre_hook(before) for r in routers]
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t
    ):
        trainer.steps.train_step(trainer.next_micro_batches())
    for h in hooks:
        h.remove()
    torch.save({"seen": seen, "saved": saved, "routers": len(routers)}, out)


@pytest.mark.slow
def test_a_bf16_fsdp_step_hands_routers_bf16_and_keeps_no_fp32_copy(tmp_path):
    for name, argv in {"qwen3": TINY, "dsv3": TINY_DSV3}.items():
        out = tmp_path / f"{name}.pt"
        run_distributed(_router_worker, 1, argv, str(out))
        got = torch.load(out)
        assert got["routers"] > 0 and got["seen"], name
        assert {dtype for dtype, _ in got["seen"]} == {torch.bfloat16}, (name, got["seen"])
        # Kept for backward: the routers' inputs in bf16, never an fp32 tensor of their shape.
        shapes = {shape for _, shape in got["seen"]}
        assert {(torch.bfloat16, shape) for shape in shapes} <= set(got["saved"]), name
        assert not [s for d, s in got["saved"] if d == torch.float32 and s in shapes], name
