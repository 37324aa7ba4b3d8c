"""The planner's meta shortcuts (`moetrain.planner.meta_trace.meta_op`): element-wise and
foreach ops whose meta kernels are Python loops are shaped directly. Each shortcut must
give what the op's own meta kernel gives, and the update the planner measures with them
(`footprint.update_transient`: norm, clip, AdamW's foreach step) must be the same bytes.
And the search's worker pool loses no measurement when a worker dies.
The traces' element-wise ops are checked the same way over whole traces in
tests/test_dry_run_phases.py."""

from __future__ import annotations

import os

import torch
from torch import nn

from moetrain.planner import footprint, meta_trace


def _model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 33, bias=False))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, foreach=True)


def _shortcut_op(func) -> bool:
    shortcuts = meta_trace.ELEMENTWISE | meta_trace.FOREACH_IN_PLACE
    return func in shortcuts or func is torch.ops.aten._foreach_sqrt.default


def test_each_shortcut_gives_what_the_meta_kernel_gives(monkeypatch):
    shortcut, checked, wrong = meta_trace.meta_op, [], []

    def checking(func, args, kwargs):
        got = shortcut(func, args, kwargs)
        if _shortcut_op(func):
            ref = func(*args, **kwargs)  # the op's own kernel
            checked.append(str(func))
            pairs = zip(got, ref, strict=True) if isinstance(ref, list) else [(got, ref)]
            for g, r in pairs:
                if (r is None) != (g is None) or (
                    r is not None and (g.shape, g.dtype, g.stride()) != (r.shape, r.dtype, r.stride())
                ):  # fmt: skip
                    wrong.append(str(func))
        return got

    model = _model()
    monkeypatch.setattr(meta_trace, "meta_op", checking)
    with_shortcuts = footprint.update_transient(_optimizer(model), {})
    # One mesh group takes the norm in one op (moetrain.parallelisms.clip), without the square the
    # sharded norm sums; that shortcut is checked on its own.
    squares = torch.empty(3, 5, device="meta").t()
    checking(torch.ops.aten.pow.Tensor_Scalar, (squares, 2), {})
    assert not wrong, wrong
    assert {"aten._foreach_addcmul_.Scalar", "aten._foreach_sqrt.default", "aten.pow.Tensor_Scalar"} <= set(checked)  # fmt: skip

    def kernels(func, args, kwargs):  # every op by its own kernel
        if _shortcut_op(func):
            return func(*args, **kwargs)
        return shortcut(func, args, kwargs)

    monkeypatch.setattr(meta_trace, "meta_op", kernels)
    assert footprint.update_transient(_optimizer(model), {}) == with_shortcuts > 0


def _dies_in_a_worker(value: int, measured=None) -> int:
    """A search job that kills the worker process running it (`measured` is None there)."""
    if measured is None:
        os._exit(1)
    return value


def test_the_search_runs_here_what_a_dead_worker_left():
    """`workers.SearchPool`: jobs no worker started, and jobs a worker held when it died,
    run in the planner's own process; every result arrives."""
    from moetrain.planner.layout_cost import Measured
    from moetrain.planner.workers import SearchPool, resolved

    pool, cache = SearchPool(1, 1), {}
    try:
        pool.submit([(cache, i, _dies_in_a_worker, (i,)) for i in range(4)])
        assert pool.take_back(Measured()) == 4
        assert [resolved(cache[i]) for i in range(4)] == [0, 1, 2, 3]
    finally:
        pool.close()


def test_narrow_v_attention_keeps_what_the_memory_efficient_kernel_keeps():
    """MLA's V head (narrower than Q/K's) under the planner's `FusedAttention`: the same
    output and gradients as the fused CPU kernel on V padded to Q's width, bit for bit,
    while it keeps q, k, v, the output at V's width (laid out [B, S, H, Dv], so that the
    output projection's input is a view) and the log-sum-exp, as CUDA's memory-efficient
    kernel does; padded, it kept V and the output at Q's width."""
    import torch.nn.functional as F
    from torch.autograd.graph import saved_tensors_hooks

    g = torch.Generator().manual_seed(0)
    B, H, S, D, Dv = 2, 4, 16, 12, 8
    q, k = (torch.randn(B, H, S, D, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, S, Dv, generator=g, requires_grad=True)

    def padded(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, F.pad(v, (0, D - Dv)), 0.0, True, scale=0.3
        )
        return out[0][..., :Dv]

    def run(fn):
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            out = fn(q, k, v)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v)), sum(saved.values())

    def fused(q, k, v):
        with meta_trace.FusedAttention():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)

    ours, reference = run(fused), run(padded)
    assert torch.equal(ours[0], reference[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], reference[1], strict=True))
    assert ours[0].transpose(1, 2).is_contiguous()  # [B, S, H, Dv] in memory
    f32 = 4
    lse = B * H * S * f32
    assert ours[2] == (2 * B * H * S * D + 2 * B * H * S * Dv) * f32 + lse
    assert reference[2] == (2 * B * H * S * D + 2 * B * H * S * D) * f32 + lse
