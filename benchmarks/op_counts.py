"""Ops launched per training step and per MoE layer: ours against torchtitan 0.2.2's Qwen3 MoE.

    python benchmarks/op_counts.py [--layers=2 --seq=64 --rounds=20 --gemm=loop --json=PATH]

Both sides at the tiny widths of benchmarks/vs_torchtitan.py (`TINY`: 8 experts, top-2),
fp32 on CPU, one process (a world of one, FSDP2 on a 1-rank mesh), the same random tokens:

- a step: ours is the `Trainer`'s step as train.py runs it (`Trainer.advance`: loss, guard,
  clipping, fused AdamW, the previous step's record read), torchtitan's its `train_step`
  restated (benchmarks/titan_side.py: its loss, clipping, fused AdamW, expert-bias update);
- one MoE layer's forward and backward (the same input and output gradient on both).

Each op that reaches the dispatcher is counted once (`OpCounter`, below autograd: a
composite such as `linear` counts as the ops it runs, and a backward's ops are counted
too). On a GPU each non-view op is at least one kernel launch and each op costs the host its
dispatch, so where both trainers are bound by launches (docs/gpus.md) the count is a proxy
for the step's host time. Then the steps are timed on CPU, the two sides interleaved (one
step of each per round), as a second proxy.

The experts: torchtitan has no CPU path for its grouped GEMM (its token padding is a Triton
kernel), so on CPU it loops over experts; `--gemm=loop` (the default) makes ours loop
too, for a like-for-like count, and `--gemm=grouped_mm` counts ours as it runs on CPU.
Prints one JSON object (benchmarks/report.py), then a one-line summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_result  # noqa: E402
from benchmarks.vs_torchtitan import LR, MAX_GRAD_NORM, TINY  # noqa: E402


class IntegerHistc(TorchDispatchMode):
    """Runs every op as it is, except one: torchtitan's router counts tokens per expert with
    `torch.histc` on integer expert ids, which has a CUDA kernel but no CPU one; here such a
    call is computed through a float copy (exact: ids < 2^24). No function of torch or
    torchtitan is replaced, and the mode is active only around the calls it serves.

    NOTE: a Python dispatch mode costs each op a little host time; the timings run both sides
    under it, so that cost is the same per op on both."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            ids = args[0]  # run with this mode off (inside __torch_dispatch__): one op counted
            return func(ids.float(), *args[1:], **kwargs).to(ids.dtype)
        return func(*args, **kwargs)


class OpCounter(IntegerHistc):
    """Counts every op dispatched while it is active, by name (`counts`); an integer
    histogram counts as the one op it is on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views = 0  # aten ops that only make a view: no kernel on a GPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.counts[name] += 1
        self.views += bool(func.is_view) and name.startswith("aten::")
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def aten(self) -> int:
        """The aten ops (not the collectives' c10d ops, FSDP's own, nor profiler ranges)."""
        return sum(n for name, n in self.counts.items() if name.startswith("aten::"))

    def summary(self, top: int = 12) -> dict:
        return {
            "aten_ops": self.aten,
            "non_view_aten_ops": self.aten - self.views,
            "other_ops": {k: n for k, n in self.counts.items() if not k.startswith("aten::")},
            "most_common": dict(self.counts.most_common(top)),
        }


def count(fn) -> OpCounter:
    """The ops `fn()` dispatches."""
    with OpCounter() as counter:
        fn()
    return counter


def step_args(args) -> argparse.Namespace:
    """What vs_torchtitan's builders read of its command line."""
    return argparse.Namespace(
        layers=args.layers, seq=args.seq, warmup=args.rounds, steps=args.rounds,
        profile_steps=2, accum=1, compile=False, tiny=True,
        overrides=[f"--moe.gemm={args.gemm}", "--metrics.log_interval=1000000"],
    )  # fmt: skip


def build_steps(args) -> dict:
    """{side: (step, batches)}: each side's step function and its micro-batches of the same
    random tokens, one list per step to run (counted, warm-up and timed)."""
    from benchmarks.titan_side import build_torchtitan
    from benchmarks.vs_torchtitan import build_ours

    device = torch.device("cpu")
    bargs = step_args(args)
    shapes = dict(TINY, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    out_dir = tempfile.mkdtemp(prefix="op_counts_")
    ours = build_ours(bargs, shapes, device, out_dir)
    theirs = build_torchtitan(bargs, shapes, device, LR, MAX_GRAD_NORM)
    steps = 2 * args.rounds + 3
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shapes["vocab_size"], (steps, 1, 1, args.seq + 1), generator=gen)
    return {
        side: (built[1], [built[0](t) for t in tokens])
        for side, built in (("ours", ours), ("torchtitan", theirs))
    }


def moe_layers(args) -> dict:
    """{side: (layer, x, grad)}: one MoE layer of each at the tiny widths, initialised by its
    own code, the same input [1, seq, dim] and output gradient."""
    from benchmarks.titan_side import import_torchtitan_qwen3
    from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter

    dim, hidden = TINY["hidden_size"], TINY["moe_intermediate_size"]
    experts, top_k = TINY["num_experts"], TINY["num_experts_per_tok"]
    torch.manual_seed(0)
    ours = MoE(dim, hidden, TopKRouter(dim, experts, top_k, True), MoEOptions(gemm=args.gemm))
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.02)
    qwen3 = import_torchtitan_qwen3()
    from torchtitan.models.moe import MoE as TitanMoE

    moe_args = qwen3.qwen3_args["30B-A3B"].moe_args
    moe_args = type(moe_args)(**{**vars(moe_args), "num_experts": experts, "top_k": top_k})
    moe_args.use_grouped_mm = False  # its CPU path (see the module's docstring)
    theirs = TitanMoE(moe_args, dim, hidden)
    with torch.no_grad():  # as torchtitan's trainer calls it
        theirs.init_weights(0.02, torch.device("cpu"))
    x = torch.randn(1, args.seq, dim)
    grad = torch.randn(1, args.seq, dim)
    return {"ours": (ours, x, grad), "torchtitan": (theirs, x, grad)}


def experts_fwd_bwd(layer, tokens: int) -> None:
    """The experts' arithmetic alone (their GEMMs and activation, as each side's experts
    module computes it) on `tokens` routed rows split evenly, forward and backward."""
    dim, experts = TINY["hidden_size"], TINY["num_experts"]
    rows = torch.randn(tokens, dim, requires_grad=True)
    per_expert = torch.full((experts,), tokens // experts, dtype=torch.int64)
    ffn = getattr(layer.experts, "ffn", layer.experts)  # ours: `ffn`; torchtitan: the module
    ffn(rows, per_expert).backward(torch.ones(tokens, dim))


def layer_fwd_bwd(layer, x: torch.Tensor, grad: torch.Tensor) -> None:
    y = layer(x.detach().requires_grad_())
    y = y[0] if isinstance(y, tuple) else y  # ours returns (y, routing statistics)
    y.backward(grad)


def interleaved(runs: dict, rounds: int) -> dict:
    """Median seconds of each side's call, one call of each side per round, alternating
    which goes first, each under `IntegerHistc`."""
    times: dict[str, list[float]] = {side: [] for side in runs}
    for i in range(rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for side in order:
            with IntegerHistc():  # both sides: the same cost per op (see its NOTE)
                start = time.perf_counter()
                runs[side](i)
                times[side].append(time.perf_counter() - start)
    return {side: statistics.median(t) for side, t in times.items()}


def measure(args, timed: bool = True) -> dict:
    """The counts (aten ops) and, if `timed`, the interleaved timings of both sides (a
    process group of one is made, and destroyed). Besides each side's whole step and MoE
    layer: its experts' arithmetic alone (`experts_fwd_bwd`), and the step and the layer
    without it: what routing, statistics, permutation, combine, loss, norm, clipping, the
    guard and the optimizer cost, the experts' GEMMs (a loop on CPU) left out."""
    from moetrain.build.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    step_ops, layer_ops, expert_ops, times = {}, {}, {}, {}
    try:
        steps = build_steps(args)
        for side, (step, batches) in steps.items():
            with IntegerHistc():  # the first steps build state (optimizer moments, tables)
                for b in batches[:2]:
                    step(b)
            step_ops[side] = count(lambda s=step, b=batches[2]: s(b)).summary()
        if timed:
            runs = {side: (lambda i, s=s, b=b: s(b[3 + i])) for side, (s, b) in steps.items()}
            times["step_time_s"] = interleaved(runs, args.rounds)
        layers = moe_layers(args)
        for side, (layer, x, grad) in layers.items():
            with IntegerHistc():
                layer_fwd_bwd(layer, x, grad)
            layer_ops[side] = count(lambda a=(layer, x, grad): layer_fwd_bwd(*a)).summary()
            routed = args.seq * TINY["num_experts_per_tok"]
            expert_ops[side] = count(lambda m=layer, n=routed: experts_fwd_bwd(m, n)).aten
        if timed:
            runs = {side: (lambda i, a=a: layer_fwd_bwd(*a)) for side, a in layers.items()}
            times["moe_layer_time_s"] = interleaved(runs, args.rounds)
    finally:
        dist.destroy_process_group()
    for side in steps:
        step_ops[side]["aten_ops_without_experts"] = (
            step_ops[side]["aten_ops"] - args.layers * expert_ops[side]
        )
        layer_ops[side]["experts_aten_ops"] = expert_ops[side]
        layer_ops[side]["aten_ops_without_experts"] = layer_ops[side]["aten_ops"] - expert_ops[side]
    return {"per_step": step_ops, "per_moe_layer_fwd_bwd": layer_ops, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (and warm-up)")
    parser.add_argument("--gemm", choices=("loop", "grouped_mm"), default="loop",
                        help="our experts' GEMM (torchtitan's on CPU is a loop)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the JSON here (default: stdout)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host's dispatch cost, not the CPU's arithmetic, is measured
    result = {
        "benchmark": "op_counts",
        "command": " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "shapes": dict(TINY, num_hidden_layers=args.layers),
        "seq_len": args.seq,
        "micro_batch_size": 1,
        "dtype": "float32",
        "our_gemm": args.gemm,
        **measure(args),
    }
    write_result(result, args.json)
    steps, layers = result["per_step"], result["per_moe_layer_fwd_bwd"]
    times = result["step_time_s"]

    def pair(figures: dict, key: str) -> str:
        return f"{figures['ours'][key]} vs {figures['torchtitan'][key]}"

    print(
        f"aten ops, ours vs torchtitan: per step {pair(steps, 'aten_ops')} "
        f"({pair(steps, 'aten_ops_without_experts')} without the experts' GEMMs); per MoE "
        f"layer fwd+bwd {pair(layers, 'aten_ops')} ({pair(layers, 'aten_ops_without_experts')}); "
        f"CPU step, interleaved: {1000 * times['ours']:.1f} vs "
        f"{1000 * times['torchtitan']:.1f} ms ({args.layers} layers x seq {args.seq}, "
        f"our GEMM {args.gemm})"
    )


if __name__ == "__main__":
    main()
