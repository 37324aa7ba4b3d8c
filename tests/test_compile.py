"""`train.compile = true` (regional torch.compile of each block, inductor on CPU) trains
like eager: the debug Qwen3-MoE (at the parity tests' tiny size), fp32 on CPU, 3 steps,
on 1 rank, and on 2 ranks with expert parallelism (also under
`activation_checkpoint=full`). Losses, grad norms, every gradient and updated parameter agree within 1e-5
(not bitwise: inductor fuses and reorders the element-wise math), and the all-to-all sends
the same bytes. The compiled runs really ran compiled graphs (dynamo's own counters).

The runs go through `Trainer` without the parity harness's router hooks, so the compiled
blocks are the ones a real run gets (a test hook inside a block would break its graph).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.common.grouped_gemm import grouped_mm_op
from models.common.moe import grouped_mm
from tests.distributed import run_distributed
from tests.parity import STEPS, TINY, build_trainer, stepped_records
from trainer.config import ConfigError, load_config

TOL = 1e-5
BF16_TOL = 1e-2  # see test_compile_matches_eager_in_bf16
MODES = {  # name: extra argv
    "eager": [],
    "compile": ["--train.compile=true"],
    "compile_full_ac": ["--train.compile=true", "--train.activation_checkpoint=full"],
}


def _train(world: int, argv: list[str]) -> list[dict]:
    """3 steps through `Trainer`: each step's record, the gradients the optimizer stepped
    with (after clipping) and the updated parameters, as full tensors."""
    return list(stepped_records(build_trainer(argv, world)[1], STEPS))


def _modes_worker(rank: int, world: int, argv: list[str], modes: list[str], out: str) -> None:
    """The modes one after the other on the same ranks (one spawn per layout)."""
    from torch._dynamo.utils import counters

    for mode in modes:
        # NOTE: a fresh start per mode, so that each compiled run compiles (and counts) its
        # own graphs instead of reusing the previous run's from dynamo's cache.
        torch._dynamo.reset()
        counters.clear()
        records = _train(world, [*argv, *MODES[mode]])
        sent = [None] * world
        dist.all_gather_object(sent, [r.get("a2a_bytes") for r in records])
        if rank == 0:
            dynamo = {
                "graphs": counters["stats"]["unique_graphs"],
                "breaks": dict(counters["graph_break"]),
            }
            torch.save({"records": records, "a2a_bytes": sent, **dynamo}, f"{out}/{mode}.pt")


def _max_diffs(ours: list[dict], ref: list[dict]) -> dict[str, float]:
    """The largest |ours - ref| over the steps, per quantity (tensors: over elements)."""
    diffs = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0}
    for o, r in zip(ours, ref, strict=True):
        for key in ("loss", "grad_norm"):
            diffs[key] = max(diffs[key], abs(o[key] - r[key]))
        for kind in ("grads", "params"):
            assert o[kind].keys() == r[kind].keys()
            for name, tensor in r[kind].items():
                diffs[kind] = max(diffs[kind], (o[kind][name] - tensor).abs().max().item())
    return diffs


def _run(
    tmp_path, world: int, layout: list[str], modes: list[str], tol: float = TOL
) -> dict[str, dict]:
    run_distributed(_modes_worker, world, [*TINY, *layout], modes, str(tmp_path))
    runs = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes}
    eager = runs["eager"]
    assert eager["graphs"] == 0
    for mode in modes[1:]:
        assert runs[mode]["graphs"] > 0, f"{mode}: nothing was compiled"
        diffs = _max_diffs(runs[mode]["records"], eager["records"])
        print(f"{mode} vs eager, world {world} {layout}: max |diff| {diffs}")
        assert all(d <= tol for d in diffs.values()), f"{mode}: {diffs}"
    return runs


@pytest.mark.slow
def test_compile_matches_eager_one_rank(tmp_path):
    runs = _run(tmp_path, 1, [], ["eager", "compile"])
    # One rank: no all-to-all, and fp32's grouped GEMM traces as one op: one graph a block.
    assert runs["compile"]["breaks"] == {}


@pytest.mark.slow
def test_compile_matches_eager_ep2(tmp_path):
    runs = _run(tmp_path, 2, ["--parallel.ep=2"], list(MODES))
    # Per rank and step: the same tokens crossed ranks. Full checkpointing's replay
    # dispatches and combines again: half a step more (as in eager, test_activation_checkpoint).
    none, compiled, full = (runs[m]["a2a_bytes"] for m in MODES)
    assert compiled == none and all(b > 0 for rank in none for b in rank), (none, compiled)
    assert [[2 * b for b in rank] for rank in full] == [[3 * b for b in rank] for rank in none]
    assert runs["compile"]["breaks"], "the graph breaks at the experts' hooks under EP"


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_fp32_grouped_mm_traces_as_one_op(impl):
    """fp32 grouped GEMM under torch.compile: no failure, no graph break, eager's numbers
    and gradients (aot_eager: the tracing and autograd path without inductor's C++ build).
    `opcheck` checks the op's fake kernel and autograd registration against the real one."""
    counts = torch.tensor([3, 0, 5, 2])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    grad_out = torch.randn(10, 24, generator=g)
    compiled = torch.compile(grouped_mm, backend="aot_eager", fullgraph=True)
    out = compiled(x, w, counts, impl)
    ref = grouped_mm(x, w, counts, impl)
    assert torch.equal(out, ref)
    for ours, theirs in zip(
        torch.autograd.grad(out, (x, w), grad_out),
        torch.autograd.grad(ref, (x, w), grad_out),
        strict=True,
    ):
        assert torch.equal(ours, theirs)
    torch.library.opcheck(grouped_mm_op, (x, w, counts, impl))


def test_compile_with_selective_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="train.compile=true cannot compile under"):
        load_config([*TINY, "--train.compile=true", "--train.activation_checkpoint=selective"])


@pytest.mark.slow
def test_compile_matches_eager_in_bf16(tmp_path):
    """bf16 on CPU: inductor's fused element-wise math rounds to bf16 at other places than
    eager's op-by-op kernels, so the runs agree to bf16's precision (measured: 6e-4 on the
    loss, 5e-3 on the grad norm, 3e-3 on any gradient or parameter), not fp32's."""
    runs = _run(tmp_path, 1, ["--train.mixed_precision=bf16"], ["eager", "compile"], tol=BF16_TOL)
    # The graph breaks only at the router: its own FSDP unit in fp32 under bf16, whose
    # all-gather hooks dynamo skips (parallelisms/compile.py).
    breaks = runs["compile"]["breaks"]
    assert breaks and all("skipping FSDP hooks" in b or "`disable`" in b for b in breaks), breaks
