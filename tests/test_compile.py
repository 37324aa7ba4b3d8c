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

from moetrain.config import ConfigError, load_config
from moetrain.models.common.grouped_gemm import grouped_mm, grouped_mm_op
from moetrain.models.common.moe import MoE, TopKRouter
from tests.distributed import run_distributed
from tests.parity import STEPS, TINY, build_trainer, stepped_records

TOL = 1e-5
BF16 = ["--train.mixed_precision=bf16"]
U_BF16 = 2.0**-8  # bf16's unit roundoff: the largest relative error of one rounding
MODES = {  # name: extra argv
    "eager": [],
    "compile": ["--train.compile=true"],
    "compile_full_ac": ["--train.compile=true", "--train.activation_checkpoint=full"],
}


def _train(world: int, argv: list[str]) -> list[dict]:
    """3 steps through `Trainer`: each step's record, the gradients the optimizer stepped
    with (after clipping) and the updated parameters, as full tensors."""
    return list(stepped_records(build_trainer(argv, world)[1], STEPS))


def _modes_worker(
    rank: int, world: int, argv: list[str], modes: dict[str, list[str]], out: str
) -> None:
    """The modes ({name: extra argv}) one after the other on the same ranks (one spawn per
    layout)."""
    from torch._dynamo.utils import counters

    for mode, extra in modes.items():
        # NOTE: a fresh start per mode, so that each compiled run compiles (and counts) its
        # own graphs instead of reusing the previous run's from dynamo's cache.
        torch._dynamo.reset()
        counters.clear()
        records = _train(world, [*argv, *extra])
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


def _run(tmp_path, world: int, layout: list[str], modes: list[str]) -> dict[str, dict]:
    argvs = {mode: MODES[mode] for mode in modes}
    run_distributed(_modes_worker, world, [*TINY, *layout], argvs, str(tmp_path))
    runs = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes}
    eager = runs["eager"]
    assert eager["graphs"] == 0
    for mode in modes[1:]:
        assert runs[mode]["graphs"] > 0, f"{mode}: nothing was compiled"
        diffs = _max_diffs(runs[mode]["records"], eager["records"])
        print(f"{mode} vs eager, world {world} {layout}: max |diff| {diffs}")
        assert all(d <= TOL for d in diffs.values()), f"{mode}: {diffs}"
    return runs


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory) -> dict[str, dict]:
    """One launch of one rank for both one-rank tests: fp32 eager and compiled, bf16 eager
    and compiled (each mode compiles its own graphs: dynamo is reset between them)."""
    out = tmp_path_factory.mktemp("one_rank")
    runs = {
        "fp32": [],
        "fp32_compile": MODES["compile"],
        "bf16": BF16,
        "bf16_compile": [*BF16, *MODES["compile"]],
    }
    run_distributed(_modes_worker, 1, TINY, runs, str(out))
    return {mode: torch.load(out / f"{mode}.pt") for mode in runs}


@pytest.mark.slow
def test_compile_matches_eager_one_rank(one_rank_runs):
    eager, compiled = one_rank_runs["fp32"], one_rank_runs["fp32_compile"]
    assert eager["graphs"] == 0 and compiled["graphs"] > 0, "nothing was compiled"
    diffs = _max_diffs(compiled["records"], eager["records"])
    print(f"compile vs eager, one rank: max |diff| {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    # One rank: no all-to-all, and fp32's grouped GEMM traces as one op: one graph a block.
    assert compiled["breaks"] == {}


@pytest.mark.slow
def test_compile_matches_eager_ep2(tmp_path):
    runs = _run(tmp_path, 2, ["--parallel.ep=2"], list(MODES))
    # Per rank and step: the same tokens crossed ranks. Full checkpointing's replay
    # dispatches and combines again: half a step more over the ranks (as in eager,
    # test_activation_checkpoint; a rank's routing weights go out in forward and those it
    # received come back, so per rank forward and backward differ).
    none, compiled, full = (runs[m]["a2a_bytes"] for m in MODES)
    assert compiled == none and all(b > 0 for rank in none for b in rank), (none, compiled)
    per_step = lambda run: [sum(step) for step in zip(*run, strict=True)]  # noqa: E731
    assert [2 * b for b in per_step(full)] == [3 * b for b in per_step(none)]
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


def test_a_compiled_moe_layer_routes_counts_and_backpropagates_as_eager_does():
    """Inductor on CPU, one MoE layer of one sequence: its output, routing statistics and
    every gradient are eager's. Two bugs this caught: the per-sequence counts were a scalar
    `scatter_(..., reduce="add")`, which inductor lowers with its ones shaped like the
    output, not the index (the compiled layer failed; the 3-block training above did not
    reach that lowering); and the routed sum's in-place `index_add_` inside its autograd
    Function, which torch 2.11's compile took for an output of nothing: the experts got no
    gradient at all (moetrain/models/common/row_sum.py)."""
    torch.manual_seed(0)
    moe = MoE(16, 8, TopKRouter(16, 8, 2, True))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 64, 16, requires_grad=True)

    def run(layer) -> tuple:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        out, stats = layer(x)
        (out.square().sum() + stats.prob_sum.square().sum()).backward()
        grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
        return out.detach(), stats.tokens_per_expert, grads

    (ref, ref_counts, ref_grads), (out, counts, grads) = run(moe), run(torch.compile(moe))
    torch.testing.assert_close(out, ref)
    assert torch.equal(counts, ref_counts) and counts.sum() == 64 * 2
    # Norm-wise, as the training tests hold gradients (inductor reorders fp32 sums: 1.5e-6)
    errors = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items()}
    assert all(g.norm() > 0 for g in ref_grads.values())
    assert all(e <= 1e-5 for e in errors.values()), errors


def test_compile_with_selective_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="train.compile=true cannot compile under"):
        load_config([*TINY, "--train.compile=true", "--train.activation_checkpoint=selective"])


def _flat(record: dict, kind: str) -> torch.Tensor:
    return torch.cat([t.flatten() for _, t in sorted(record[kind].items())])


def _rel_errors(ours: list[dict], ref: list[dict]) -> dict[str, float]:
    """The largest norm-wise relative error of ours against ref over the steps, per quantity
    (the gradients, and the weights, each as one vector)."""
    errors = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0}
    for o, r in zip(ours, ref, strict=True):
        for key in ("loss", "grad_norm"):
            errors[key] = max(errors[key], abs(o[key] - r[key]) / abs(r[key]))
        for kind in ("grads", "params"):
            assert o[kind].keys() == r[kind].keys()
            x, y = _flat(o, kind), _flat(r, kind)
            errors[kind] = max(errors[kind], ((x - y).norm() / y.norm()).item())
    return errors


@pytest.mark.slow
def test_compile_matches_eager_in_bf16(one_rank_runs):
    """bf16 on CPU: inductor's fused element-wise math rounds to bf16 at other places than
    eager's op-by-op kernels, so the runs agree to bf16's precision, not fp32's: each is held
    against the same run in fp32, to a bound from a model of rounding."""
    out = {
        "fp32": one_rank_runs["fp32"],
        "eager": one_rank_runs["bf16"],
        "compile": one_rank_runs["bf16_compile"],
    }
    assert out["eager"]["graphs"] == 0 and out["compile"]["graphs"] > 0
    ref = out["fp32"]["records"]
    errors = {mode: _rel_errors(out[mode]["records"], ref) for mode in ("eager", "compile")}
    # A bound from a model of rounding, not from one CPU's kernels (inductor's C++ and
    # eager's kernels both follow the instruction set). Each op rounds its output once, by
    # at most u = 2^-8 of it (its sums run in fp32). A step's gradient passes the forward's
    # roundings along the depth (about 20 a block: norms, projections, q/k norms, RoPE's
    # three, attention, residual adds, the expert's gate/up, SiLU, product, down, weight and
    # sum; 2 at the head), the backward's as many, and its own: N = 2 (20 L + 2) + 1.
    # Independent roundings add in quadrature (probabilistic rounding error analysis,
    # Higham and Mary 2019), and norms and clipping rescale a norm-wise error without
    # growing it: sqrt(N) u, 0.044 for TINY's 3 blocks, for compile and eager each (so within
    # twice that of each other); the loss and the grad norm, sums of many rounded terms, come
    # far inside. Adam moves a weight by about lr (3e-3, a sixth of the init's 0.02) a step
    # whatever its gradient, so the weights differ by a small part of that (0.3 u here) and
    # their check catches gross mistakes only. Steps 2 and 3 start from those weights: the
    # extra rounding-sized difference is outside the count and inside its room (here at
    # most 3.5 u, the gradients at step 3, against 11.2 u).
    layers = load_config(TINY).model.args.num_hidden_layers
    bound = (2 * (20 * layers + 2) + 1) ** 0.5 * U_BF16
    print(f"bf16 against fp32, norm-wise relative (bound {bound:.3g}): {errors}")
    assert all(e <= bound for mode in errors.values() for e in mode.values()), errors
    # The graph breaks only at the router: its own FSDP unit in fp32 under bf16, whose
    # all-gather hooks dynamo skips (moetrain/parallelisms/compile.py).
    breaks = out["compile"]["breaks"]
    assert breaks and all("skipping FSDP hooks" in b or "`disable`" in b for b in breaks), breaks
