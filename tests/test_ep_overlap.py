"""`parallel.ep_overlap`: the expert all-to-all in flight while the layer computes.

One 4-rank launch of the tiny DeepSeek-V3 (a shared expert per MoE layer), over gloo,
whose collectives run on threads of their own, so the overlap is real on CPU too:
- ep2 x efsdp2: 2 steps with the combine under the shared experts (`shared`) equal 2 steps
  without overlap bit for bit.
  Only when the transfer is waited for moves; the arithmetic is the same. (Against one
  process, within 1e-5: the EP rows of tests/test_layout_parity.py, which run `shared`
  and `chunks` over 5 steps; `chunks` splits the weight-gradient sums, so it is not
  bit-equal.)
- one profiled step per mode, read from the profiler's events on every rank: each
  transfer left in flight is issued before the compute it hides and waited for after it,
  forward and backward, in every MoE layer; with `none`, nothing is left to wait for.
- DualPipeV (pp2 x ep2, the tiny Qwen3-MoE): its overlapped pairs of a forward and a
  backward run on two threads (moetrain/parallelisms/pipeline_overlap.py); 2 steps equal the pairs
  run one after the other (`none`) bit for bit, and in a profiled step (every thread's
  events) an all-to-all of each thread runs while the other thread computes.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, build_trainer, stepped_records

CASES = {
    "ep2_efsdp2": ["--parallel.ep=2"],
    "ep4_2nodes": ["--parallel.ep=4", "--parallel.ranks_per_node=2"],
}
MEASURED = {"tokens_per_s", "step_time_s", "peak_mem_gib", "mfu"}  # of the run, not the model
MOE_LAYERS = 3  # TINY_DSV3: 2 MoE blocks and the MTP block
# What a window between an issue and its wait may hold: the experts' two grouped GEMMs
# (gate_up, down), the shared SwiGLU's three linears, their backward nodes, and the
# two-stage dispatch's node stage.
COMPUTE = {
    "aten::_grouped_mm": "experts",
    "aten::linear": "shared",
    "autograd::engine::evaluate_function: GroupedMmBackward0": "experts_bwd",
    "autograd::engine::evaluate_function: MmBackward0": "shared_bwd",
    "ep.dispatch.node": "node_stage",
}
TRANSFERS = ("ep.dispatch", "ep.combine", "ep.dispatch.backward", "ep.combine.backward")
# Every block a MoE one (each stage has transfers to overlap), 8 micro-batches per step.
DUALPIPE = [*TINY, "--parallel.pp=2", "--parallel.pp_schedule=DualPipeV", "--parallel.ep=2",
            "--model.num_hidden_layers=4", "--model.mlp_only_layers=[]",
            "--train.global_batch_size=16", "--train.micro_batch_size=1"]  # fmt: skip
MATMULS = ("aten::mm", "aten::_grouped_mm")


def _events(prof) -> list[tuple[str, float, float]]:
    """(name, start, end) of the main thread's events that the windows are read from."""
    first = prof.events()[0].thread
    keep = set(COMPUTE) | set(TRANSFERS) | {f"{t}.wait" for t in TRANSFERS}
    return sorted(
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.thread == first and e.name in keep
    )


def windows(events: list[tuple[str, float, float]], transfer: str) -> list[dict[str, int]]:
    """For each issue of `transfer`, in order, what ran between its end and the start of its
    wait (the k-th wait of a name is the k-th issue's: transfers land in order); {} where
    the issue was never waited for (waited inside it: nothing overlapped)."""
    issues = [e for e in events if e[0] == transfer]
    waits = [e for e in events if e[0] == f"{transfer}.wait"]
    if not waits:
        return [{} for _ in issues]
    assert len(waits) == len(issues), transfer
    out = []
    for (_, _, issued), (_, landed, _) in zip(issues, waits, strict=True):
        assert issued <= landed
        inside = [(n, s, e) for n, s, e in events if n in COMPUTE and issued <= s and e <= landed]
        outer = [  # not the products inside a backward node
            COMPUTE[n]
            for n, s, e in inside
            if not any(s0 <= s and e <= e0 and (s0, e0) != (s, e) for _, s0, e0 in inside)
        ]
        out.append({kind: outer.count(kind) for kind in sorted(set(outer))})
    return out


def _worker(rank: int, world: int, out_path: str) -> None:
    results = {}
    for name, layout in CASES.items():
        # The two-stage dispatch's `shared` is held to one process by its layout row
        # (tests/test_layout_parity.py, dsv3_ep4_2nodes_shared): here its `chunks` windows.
        overlaps = ("shared", "none", "chunks") if name == "ep2_efsdp2" else ("chunks",)
        for overlap in overlaps:
            argv = [*TINY_DSV3, *layout, f"--parallel.ep_overlap={overlap}"]
            _, trainer = build_trainer(argv, world)
            if overlap != "chunks":
                records = list(stepped_records(trainer, 2))
                results[name, overlap] = [
                    {k: v for k, v in r.items() if k not in MEASURED} for r in records
                ]
            if name == "ep2_efsdp2" or overlap == "chunks":
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    trainer.steps.train_step(trainer.next_micro_batches())
                events = _events(prof)
                results["profiled", name, overlap] = {t: windows(events, t) for t in TRANSFERS}
    # NOTE: every thread's events: by default the profiler records the calling thread's
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    for overlap in ("shared", "none"):  # none: the pairs in turn, on one thread
        _, trainer = build_trainer([*DUALPIPE, f"--parallel.ep_overlap={overlap}"], world)
        records = list(stepped_records(trainer, 2))
        results["dualpipev", overlap] = [
            {k: v for k, v in r.items() if k not in MEASURED} for r in records
        ]
        with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
            trainer.steps.train_step(trainer.next_micro_batches())
        results["dualpipev_threads", overlap] = _cross_thread(prof.events())
    torch.save(results, f"{out_path}.{rank}")


def _cross_thread(events) -> dict[str, int]:
    """How many expert all-to-alls of the calling thread (the forwards) have another
    thread's matrix products inside their time, and how many of other threads (the
    overlapped backwards) have the calling thread's."""
    main = events[0].thread
    spans = [(e.time_range.start, e.time_range.end, e.thread) for e in events]
    a2a = [s for s, e in zip(spans, events) if e.name == "moetrain::all_to_all"]
    mms = [s for s, e in zip(spans, events) if e.name in MATMULS]

    def hides(t, pick) -> bool:
        return any(pick(m[2]) and m[2] != t[2] and t[0] <= m[0] and m[1] <= t[1] for m in mms)

    return {
        "forward_hides_backward": sum(hides(t, lambda th: th != main) for t in a2a if t[2] == main),
        "backward_hides_forward": sum(hides(t, lambda th: th == main) for t in a2a if t[2] != main),
    }


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


# What each transfer's window holds in every MoE layer (one micro-batch), in issue order.
# [{}]: issued and waited for at once; []: none issued (a gradient's way back waited for at
# once is the plain reverse op, "ep.all_to_all.backward").
SHARED = {
    "ep.dispatch": [{}],
    "ep.combine": [{"shared": 3}],
    "ep.dispatch.backward": [],
    "ep.combine.backward": [{"shared_bwd": 3}],
}
NONE = {
    "ep.dispatch": [{}],
    "ep.combine": [{}],
    "ep.dispatch.backward": [],
    "ep.combine.backward": [],
}
# Chunks A and B. Forward: B's dispatch under A's experts (and, two-stage, A's node stage),
# A's combine under B's experts and the shared experts, B's combine under the shared ones.
# Backward, in reverse: B's combine gradient under the shared experts' backward, A's also
# under B's experts' backward; B's dispatch gradient under A's experts' backward.
CHUNKS = {
    "ep.dispatch": [{}, {"experts": 2}],
    "ep.combine": [{"experts": 2, "shared": 3}, {"shared": 3}],
    "ep.dispatch.backward": [{"experts_bwd": 2}, {}],
    "ep.combine.backward": [{"shared_bwd": 3}, {"experts_bwd": 2, "shared_bwd": 3}],
}


@pytest.mark.slow
def test_the_all_to_all_runs_under_the_layers_compute(tmp_path):
    out = str(tmp_path / "out.pt")
    run_distributed(_worker, 4, out)
    for rank in range(4):
        results = torch.load(f"{out}.{rank}")
        overlapped, waited = results["ep2_efsdp2", "shared"], results["ep2_efsdp2", "none"]
        assert overlapped[0]["loss"] > 0 and overlapped[-1]["params"]
        _assert_equal(overlapped, waited, f"rank {rank} ep2_efsdp2")
        expected = {
            ("ep2_efsdp2", "shared"): SHARED,
            ("ep2_efsdp2", "none"): NONE,
            ("ep2_efsdp2", "chunks"): CHUNKS,
            ("ep4_2nodes", "chunks"): {
                **CHUNKS,
                # ... and chunk B's rail stage also under A's node stage, A's combine
                # under B's node stage.
                "ep.dispatch": [{}, {"experts": 2, "node_stage": 1}],
                "ep.combine": [{"experts": 2, "node_stage": 1, "shared": 3}, {"shared": 3}],
            },
        }
        for (name, overlap), per_layer in expected.items():
            got = results["profiled", name, overlap]
            want = {t: w * MOE_LAYERS for t, w in per_layer.items()}
            assert got == want, f"rank {rank} {name} {overlap}: {got}"
        overlapped, waited = results["dualpipev", "shared"], results["dualpipev", "none"]
        assert overlapped[0]["loss"] > 0
        _assert_equal(overlapped, waited, f"rank {rank} dualpipev")
        threads = results["dualpipev_threads", "shared"]
        assert threads["forward_hides_backward"] >= 1, (rank, threads)
        assert threads["backward_hides_forward"] >= 1, (rank, threads)
        none = results["dualpipev_threads", "none"]  # the pairs in turn: nothing beside
        assert none == {"forward_hides_backward": 0, "backward_hides_forward": 0}, (rank, none)
