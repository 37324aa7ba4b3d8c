"""`profile.steps = [a, b]`: a `torch.profiler` trace of steps a..b on every rank.

Each rank writes `<job.output_dir>/profile/step-<a>-<b>/rank-<r>.json.gz` (Chrome / Perfetto
trace format; open it in https://ui.perfetto.dev or chrome://tracing), and on CUDA a memory
snapshot beside it (`rank-<r>.memory.pickle`, for https://pytorch.org/memory_viz). Rank 0
prints the top operators by self time. Named ranges in the trace:

    step <n>                       one whole step
    data.wait                      waiting for the step's micro-batches
    <block fqn>.forward/.backward  each plan block (e.g. layers.3.forward)
    ep.dispatch, ep.combine        the expert all-to-alls (moetrain/parallelisms/expert_parallel.py)
    cp.ring.step<i>[.backward]     each ring step (moetrain/parallelisms/context_parallel.py)
    optimizer.step                 clipping, the bias update and AdamW

Outside the window nothing is registered: the hooks exist only while the profiler runs, and
the ranges of `moetrain.parallelisms.trace.named_range` read one flag.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function


class _Span:
    """The backward range of one forward of one block: opened by the first of its output
    edges autograd reaches, closed by its input edge (reached after the block's backward)."""

    def __init__(self, name: str) -> None:
        self.name, self.range, self.closed = name, None, False

    def open(self) -> None:
        if self.range is None:
            self.range = record_function(self.name)
            self.range.__enter__()

    def close(self) -> None:
        if self.range is not None and not self.closed:
            self.range.__exit__(None, None, None)
            self.closed = True


class _BackwardEdge(torch.autograd.Function):
    """Identity in forward; in backward it opens (`opening`, at a block's outputs) or closes
    (at its input) the span of that forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, span: _Span, opening: bool) -> torch.Tensor:
        ctx.span, ctx.opening = span, opening
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.opening:
            ctx.span.open()
        else:
            ctx.span.close()
        return grad, None, None


def _edge(x: Any, span: _Span, opening: bool) -> Any:
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return _BackwardEdge.apply(x, span, opening)
    return x


class _BlockRanges:
    """Forward and backward ranges of one block, from module hooks (removed after).

    A block returns a tensor or a tuple (hidden states, router statistics): every output
    tensor gets an opening edge, since its backward may start from any of them.
    """

    def __init__(self, fqn: str, block: nn.Module) -> None:
        self.fqn = fqn
        self.forwards: list[tuple[record_function, _Span]] = []
        self.handles = [
            block.register_forward_pre_hook(self._pre, with_kwargs=True),
            block.register_forward_hook(self._post),
        ]

    def _pre(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rf = record_function(f"{self.fqn}.forward")
        rf.__enter__()
        span = _Span(f"{self.fqn}.backward")
        self.forwards.append((rf, span))
        if args:
            args = (_edge(args[0], span, False), *args[1:])
        return args, kwargs

    def _post(self, _module: nn.Module, _args: tuple, out: Any) -> Any:
        rf, span = self.forwards.pop()
        rf.__exit__(None, None, None)
        if isinstance(out, tuple):
            return tuple(_edge(x, span, True) for x in out)
        return _edge(out, span, True)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class StepProfiler:
    """Starts before step `first`, stops after step `last` (1-based, inclusive)."""

    def __init__(
        self,
        steps: list[int],
        output_dir: str,
        rank: int,
        device: torch.device,
        blocks: list[tuple[str, nn.Module]],
        say: Callable[[str], None],
        top: int,
    ) -> None:
        self.window = (steps[0], steps[1]) if steps else None
        self.rank, self.device, self.blocks, self.say, self.top = rank, device, blocks, say, top
        if self.window:
            a, b = self.window
            self.dir = os.path.join(output_dir, "profile", f"step-{a}-{b}")
        self._prof: profile | None = None
        self._ranges: list[_BlockRanges] = []

    @property
    def enabled(self) -> bool:
        return self.window is not None

    def before_step(self, step: int) -> None:
        """Called before step `step` runs (a resumed run may start inside the window)."""
        if self.window and self._prof is None and self.window[0] <= step <= self.window[1]:
            self._start()

    def after_step(self, step: int) -> None:
        if self._prof is not None and step >= self.window[1]:
            self._stop()

    def _start(self) -> None:
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities)
        self._prof.start()
        self._ranges = [_BlockRanges(fqn, block) for fqn, block in self.blocks]
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        for ranges in self._ranges:
            ranges.remove()
        self._ranges = []
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"rank-{self.rank}.json.gz")
        prof.export_chrome_trace(trace)
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(
                os.path.join(self.dir, f"rank-{self.rank}.memory.pickle")
            )
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=self.top)
            a, b = self.window
            self.say(f"profile of steps {a}-{b}: traces in {self.dir}/ (one per rank)\n{table}")
