"""No host read inside a step on the default path (moetrain/loop/step.py): from a step's
first forward op until the next step is queued, the host reads nothing the device computes.

Two checks, since on CPU a tensor's `.tolist()` and `.numpy()` read its memory without
passing through torch's dispatcher:
- `HostReads`, a dispatch mode that records every op that hands a tensor's value to Python
  (`.item()`, `float()`, `bool()`, `if tensor:`): tests/test_guard.py queues each step of its
  layouts (1 rank, FSDP 2, EP 2 with the routing bias, CP 2; a skipped step among them) under
  it and asserts it saw none;
- the code of the step path holds no call that reads a tensor into Python (`item`,
  `tolist`, `numpy`, `cpu`), read from its source here. The allowed reads live elsewhere:
  the expert all-to-all's split sizes (moetrain/parallelisms/expert_parallel.py), the grouped GEMM's
  loop fallback, the pipeline schedules.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.checkpoint import run_state
from moetrain.loop import (
    balance,
    guard,
    losses,
    preference,
    run_report,
    step,
    stored_reference,
    trainer,
)
from moetrain.parallelisms import clip

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTS = os.path.join(_REPO, "tests")
# Ops that hand a tensor's value to Python.
_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value into Python while it is active, and on a
    CUDA device every synchronizing CUDA call besides (torch's sync debug mode: a blocking
    copy to or from the host, `.tolist()`, a `nonzero`), by the Python line that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._warnings = None

    def __enter__(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._sync_seen
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)  # restores showwarning
            self._warnings = None
        return out

    def _sync_seen(self, message, category, filename, lineno, *rest) -> None:
        """Name a sync by the innermost line of this repository that led to it."""
        if "synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()
        ours = [f for f in stack if f.filename.startswith(_REPO)]
        ours = [f for f in ours if not f.filename.startswith(_TESTS)]
        if not ours:  # the harness's own (torch's first sync debug call in a process)
            return
        where = f"{ours[-1].filename[len(_REPO) :]}:{ours[-1].lineno}"
        self.reads.append(f"cuda sync at {where} ({filename}:{lineno})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


# The functions a step runs through, from its first forward to the update queued.
STEP_PATH = [
    step.StepQueue.queue_step,
    step.StepQueue.optimizer_step,
    step.StepQueue._update_on_device,
    trainer.Trainer.forward_backward,
    run_state.RunState.seed_step,
    losses.global_counts,
    losses.StepLoss.begin,
    losses.StepLoss.start,
    losses.StepLoss.__call__,
    losses.StepLoss.output_loss,
    losses.StepLoss.router_loss,
    losses.StepLoss.end,
    preference.PreferenceLoss.begin,  # train.objective=dpo
    preference.PreferenceLoss.output_loss,
    preference.PreferenceLoss.end,
    preference.Reference.__call__,
    preference.whole_sequences,
    preference.missing_sides,
    stored_reference.ReferenceTable.__call__,  # dpo.reference=stored's lookups
    stored_reference.document_keys,
    guard.DeviceGuard.judge,
    guard.DeviceGuard._spike,
    clip.grad_norm,
    clip.clip_grads_,
    balance.BiasUpdate.__call__,
    run_report.global_load,
]
_READ_CALLS = {"item", "tolist", "numpy", "cpu"}


def _reads_in(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return [
        f"{fn.__qualname__}: .{node.func.attr}() at line {node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _READ_CALLS
    ]


def test_the_step_path_reads_no_tensor_into_python():
    found = [r for fn in STEP_PATH for r in _reads_in(fn)]
    assert found == []


def test_the_checks_see_a_read():
    """The mode and the source check each catch the reads they are for."""
    with HostReads() as seen:
        x = torch.ones(3)
        _ = float(x.sum())
        if x.any():
            pass
    assert seen.reads == ["aten::_local_scalar_dense", "aten::_local_scalar_dense"]

    def reads_a_norm(norm: torch.Tensor) -> float:
        return norm.item() + sum(norm.tolist())

    assert len(_reads_in(reads_a_norm)) == 2
