"""The planner's meta shortcuts (`trainer.dry_run.meta_trace.meta_op`): element-wise and
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

from trainer.dry_run import footprint, meta_trace


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
    from trainer.dry_run.layout_cost import Measured
    from trainer.dry_run.workers import SearchPool, resolved

    pool, cache = SearchPool(1, 1), {}
    try:
        pool.submit([(cache, i, _dies_in_a_worker, (i,)) for i in range(4)])
        assert pool.take_back(Measured()) == 4
        assert [resolved(cache[i]) for i in range(4)] == [0, 1, 2, 3]
    finally:
        pool.close()
