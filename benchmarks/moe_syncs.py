"""Host synchronisations of one MoE layer (forward + backward, one process), and their cost.

    python benchmarks/moe_syncs.py [--tokens=4096 --hidden=2048 --inter=768 --experts=128
        --topk=8 --gemm=grouped_mm,loop --dtype=bf16 --iters=20 --json FILE]

The layer is `moetrain.models.common.moe.MoE` with a `TopKRouter`, built as benchmarks/moe_layer.py
builds it (N(0, 0.02) weights; default: the Qwen3-30B-A3B proxy's shape), without expert
parallelism. Per grouped-GEMM implementation:

- `syncs`: CUDA's sync debug mode at "warn" over one forward + loss + backward, the
  warnings caught with the Python stack at each (a forward sync names the model line; the
  autograd engine replays a backward one at the `.backward()` call);
- `sync_ops`: which aten op synchronises, forward and backward alike: each op runs under a
  dispatch mode with the debug mode at "error", so an op that would synchronise raises
  before it does, is recorded with the model line or autograd node, and runs again with
  syncs allowed (NOTE: the check fires before the copy or wait, before any output is
  written, so the second run is the op's only effect);
- `wait_ms` of each: from a CUDA event enqueued just before the op to one enqueued once the
  host has it back: the GPU's idle time at that point, an upper bound of what it costs
  (with the op's own kernel, a copy of a few bytes);
- `fwd_bwd_ms`: the layer's median time, no instrument.

Last, what one more sync costs: the layer with and without a host read of its counts per
expert (`tolist()`, as expert parallelism's dispatch needs its split sizes), the experts'
GEMM on "auto" (grouped_mm where it runs). Prints one JSON object (or writes --json FILE), then a one-line
summary. On a CPU the debug mode does not exist: the code paths run, the sync figures are
null.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)
sys.path.insert(0, ROOT)

from benchmarks.moe_layer import _sync, build, time_fwd_bwd  # noqa: E402
from benchmarks.report import write_result  # noqa: E402
from moetrain.models.common.moe import MoE  # noqa: E402

SYNC = "synchroniz"  # in the debug mode's message: "called a synchronizing CUDA operation"


def repo_frames(stack: traceback.StackSummary) -> list[str]:
    """The innermost two frames of this repository's code (not this script's), as
    `path:line in function: source`, paths relative to the repository."""
    out = []
    for f in stack:
        path = os.path.relpath(f.filename, ROOT)
        # not outside the repository, nor in a virtual environment inside it, nor here
        if not path.startswith(".") and "site-packages" not in path and path != THIS:
            out.append(f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}")
    return out[-2:]


def step(layer: MoE, x: torch.Tensor, mark=lambda phase: None) -> None:
    """One forward + loss + backward of the layer; `mark(phase)` before each part."""
    mark("forward")
    y, _ = layer(x)
    mark("loss")
    loss = y.float().square().mean()
    mark("backward")
    loss.backward()
    mark("")


def count_warnings(layer: MoE, x: torch.Tensor) -> dict:
    """Syncs of one step by the debug mode's warnings, each with the stack at it."""
    found, phase = [], [""]

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC in str(message):
            here = repo_frames(traceback.extract_stack()) or [f"{filename}:{lineno}"]
            found.append({"phase": phase[0], "where": here})

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(layer, x, lambda p: phase.__setitem__(0, p))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    by_phase = {p: sum(s["phase"] == p for s in found) for p in ("forward", "loss", "backward")}
    return {"total": len(found), **by_phase, "each": found}


class SyncFinder(TorchDispatchMode):
    """Numbers every aten op of a step; on CUDA, finds those that synchronise (see the
    module's doc) and names them."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda, self.index, self.phase, self.found = cuda, 0, "", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index, self.index = self.index, self.index + 1
        if not self.cuda:
            return func(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if SYNC not in str(err):
                raise
            # the node the autograd engine is running (None in the forward)
            node = getattr(torch._C, "_current_autograd_node", lambda: None)()
            self.found.append({"index": index, "phase": self.phase, "op": str(func),
                               "autograd_node": node.name() if node is not None else None,
                               "where": repo_frames(traceback.extract_stack())})  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return func(*args, **kwargs)


class SyncTimer(TorchDispatchMode):
    """Events around the ops numbered `indices` (the same numbering as `SyncFinder`'s: the
    same step runs the same ops in the same order)."""

    def __init__(self, indices: set[int]) -> None:
        super().__init__()
        self.indices, self.index, self.timed = indices, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        index, self.index = self.index, self.index + 1
        if index not in self.indices:
            return func(*args, **(kwargs or {}))
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        host = time.perf_counter() - start
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        self.timed[index] = (before, after, host)
        return out


def study(layer: MoE, x: torch.Tensor, iters: int) -> dict:
    cuda = x.device.type == "cuda"
    step(layer, x)  # warm-up: lazy initialisations are not the layer's syncs
    finder = SyncFinder(cuda)
    with finder:
        step(layer, x, lambda p: setattr(finder, "phase", p))
    timer = SyncTimer({s["index"] for s in finder.found})
    with timer:
        step(layer, x)
    _sync(x.device)
    for s in finder.found:
        timed = timer.timed.get(s["index"])  # None: the second step ran other ops
        s["wait_ms"] = timed[0].elapsed_time(timed[1]) if timed else None
        s["host_ms"] = timed[2] * 1e3 if timed else None
    waits = [s["wait_ms"] for s in finder.found]
    out = {
        "fwd_bwd_ms": time_fwd_bwd(layer, x, iters) * 1e3,
        "ops_per_step": finder.index,
        "syncs": count_warnings(layer, x) if cuda else None,
        "sync_ops": finder.found if cuda else None,
        "sync_wait_ms": sum(waits) if cuda and None not in waits else None,
    }
    layer.zero_grad(set_to_none=True)
    return out


def injected_sync(layer: MoE, x: torch.Tensor, iters: int) -> dict:
    """The step with and without one host read of the counts per expert, in the forward
    where expert parallelism reads its split sizes."""
    without = time_fwd_bwd(layer, x, iters)
    layer.zero_grad(set_to_none=True)  # both timings start with no gradients to add to

    def read_counts(module, args) -> None:  # None: the call's arguments stay as they are
        args[1].tolist()

    hook = layer.experts.register_forward_pre_hook(read_counts)
    try:
        with_read = time_fwd_bwd(layer, x, iters)
    finally:
        hook.remove()
        layer.zero_grad(set_to_none=True)
    # a CPU has no queue to drain: there the difference is noise, not a cost
    cost = (with_read - without) * 1e3 if x.device.type == "cuda" else None
    return {"fwd_bwd_ms_without": without * 1e3, "fwd_bwd_ms_with": with_read * 1e3,
            "cost_ms": cost}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    for name, default in [("tokens", 4096), ("hidden", 2048), ("inter", 768), ("experts", 128),
                          ("topk", 8), ("iters", 20)]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--gemm", default="grouped_mm,loop", help="implementations, in order")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json", help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layer = build(args, "auto", device, dtype)  # its gemm is switched per implementation
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    shape = {k: v for k, v in vars(args).items() if k != "json"}
    result = {"benchmark": "moe_syncs", "device": name, "torch": torch.__version__, **shape,
              "impls": {}}  # fmt: skip
    for impl in args.gemm.split(","):
        layer.experts.gemm = impl
        result["impls"][impl] = study(layer, x, args.iters)
    layer.experts.gemm = "auto"  # grouped_mm wherever it runs
    result["injected_host_read"] = injected_sync(layer, x, args.iters)
    write_result(result, args.json)

    parts = []
    for impl, r in result["impls"].items():
        s = r["syncs"]
        waits = "n/a" if r["sync_wait_ms"] is None else f"{r['sync_wait_ms']:.2f} ms"
        counted = "syncs n/a" if s is None else (
            f"{s['total']} syncs a call (fwd {s['forward']}, bwd {s['backward']}), "
            f"waits {waits}")  # fmt: skip
        ops = sorted({o["op"] for o in r["sync_ops"] or []})
        parts.append(
            f"{impl} {r['fwd_bwd_ms']:.2f} ms, {counted}" + (f" ({', '.join(ops)})" if ops else "")
        )
    cost = result["injected_host_read"]["cost_ms"]
    cost = "n/a" if cost is None else f"{cost:+.3f} ms a step"
    print(f"MoE layer {args.tokens} tok x top-{args.topk} of {args.experts} ({args.dtype}, {name}, "
          f"one process): {'; '.join(parts)}; one more host read of the counts: "
          f"{cost}")  # fmt: skip


if __name__ == "__main__":
    main()
