"""`parallel.ep_overlap`: a MoE layer's combine in flight while its shared experts run.

One 4-rank launch of the tiny DeepSeek-V3 (a shared expert per MoE layer), over gloo,
whose collectives run on threads of their own, so the overlap is real on CPU too:
- ep2 x efsdp2 and ep4 over 2 simulated nodes (two-stage dispatch): 3 steps with the
  overlap equal 3 steps without it bit for bit. Only when the transfer is waited for moves;
  the arithmetic is the same. (Against one process, within 1e-5: the EP rows of
  tests/test_layout_parity.py, which run with the default overlap.)
- one profiled step, read from the profiler's events on every rank: in every MoE layer the
  combine's all-to-all is issued before the shared expert's matrix products and waited for
  after them; with `none`, no transfer is left to wait for after the combine.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TINY_DSV3, build_trainer, stepped_records

CASES = {
    "ep2_efsdp2": ["--parallel.ep=2"],
    "ep4_2nodes": ["--parallel.ep=4", "--parallel.ranks_per_node=2"],
}
MEASURED = {"tokens_per_s", "step_time_s", "peak_mem_gib", "mfu"}  # of the run, not the model
MOE_LAYERS = 3  # TINY_DSV3: 2 MoE blocks and the MTP block
SHARED_MMS = 3  # the shared SwiGLU: gate, up and down projections


def _moe_layers(events) -> list[dict]:
    """Per forward MoE layer on the main thread: the combine's issue ("ep.combine", which
    holds the all-to-all op) and, where the transfer was left running, its wait
    ("ep.combine.wait", the Work's wait), with the matrix products between the two."""
    main = sorted(
        (e for e in events if e.thread == events[0].thread), key=lambda e: e.time_range.start
    )
    combines = [e for e in main if e.name == "ep.combine"]
    layers = []
    for i, issued in enumerate(combines):
        start, end = issued.time_range.start, issued.time_range.end
        until = combines[i + 1].time_range.start if i + 1 < len(combines) else float("inf")
        ops = [e for e in main if start <= e.time_range.start and e.time_range.end <= end]
        waits = [
            e for e in main if e.name == "ep.combine.wait" and end <= e.time_range.start < until
        ]
        mms = [
            e
            for e in main
            if e.name == "aten::mm"
            and waits
            and end <= e.time_range.start
            and e.time_range.end <= waits[0].time_range.start
        ]
        layers.append(
            {
                "issues_all_to_all": any(e.name == "moetrain::all_to_all" for e in ops),
                "waits": len(waits),
                "mms_before_the_wait": len(mms),
            }
        )
    return layers


def _worker(rank: int, world: int, out_path: str) -> None:
    results = {}
    for name, layout in CASES.items():
        for overlap in ("shared", "none"):
            argv = [*TINY_DSV3, *layout, f"--parallel.ep_overlap={overlap}"]
            _, trainer = build_trainer(argv, world)
            records = list(stepped_records(trainer, 3))
            results[name, overlap] = [
                {k: v for k, v in r.items() if k not in MEASURED} for r in records
            ]
            if name == "ep2_efsdp2":
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    trainer.train_step(trainer.next_micro_batches())
                results["profiled", overlap] = _moe_layers(prof.events())
    torch.save(results, f"{out_path}.{rank}")


def _assert_equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_the_combine_runs_under_the_shared_experts_and_changes_no_bit(tmp_path):
    out = str(tmp_path / "out.pt")
    run_distributed(_worker, 4, out)
    for rank in range(4):
        results = torch.load(f"{out}.{rank}")
        for name in CASES:
            overlapped, waited = results[name, "shared"], results[name, "none"]
            assert overlapped[0]["loss"] > 0 and overlapped[-1]["params"]
            _assert_equal(overlapped, waited, f"rank {rank} {name}")
        shared, none = results["profiled", "shared"], results["profiled", "none"]
        assert len(shared) == len(none) == MOE_LAYERS  # one micro-batch's forward
        for layer in shared:
            expected = {"issues_all_to_all": True, "waits": 1, "mms_before_the_wait": SHARED_MMS}
            assert layer == expected, f"rank {rank}: {shared}"
        for layer in none:  # the transfer was waited for inside the combine: no wait left
            assert layer == {"issues_all_to_all": True, "waits": 0, "mms_before_the_wait": 0}
