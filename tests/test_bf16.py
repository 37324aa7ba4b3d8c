"""bf16 mixed precision on CPU (gloo): the numerics path every GPU run takes.

What is bf16 and what stays fp32 is read from what the code really runs: the profiler's
record of every op's input dtypes during a training step (the collectives FSDP, expert
parallelism and the ring hand to gloo included), and the tensors the optimizer holds.
Then the layouts against one rank over 20 steps, with the tolerance justified by the
spread that reduction order alone gives (docs/parallelisms.md, "bf16 mixed precision").
Checkpoints and export of bf16 runs: tests/test_bf16_checkpoints.py.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from moetrain.config import load_config
from moetrain.parallelisms.plan import match_modules
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, RemoteAssignmentCounter, build_trainer, num_experts_of

BF16 = ["--train.mixed_precision=bf16"]
NOT_TENSORS = ("", "Scalar", "ScalarList", "TensorList")
BF, F32 = "c10::BFloat16", "float"  # the profiler's names


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def dtype_worker(rank: int, world: int, argv: list[str], out: str) -> None:
    """One warm-up step, then one step under the profiler; writes what rank 0 saw."""
    cfg, trainer = build_trainer(argv, world)
    model, plan = trainer.model, trainer.spec.plan
    fp32_units = [m for _, m in match_modules(model, plan.fp32_modules, "fp32", required=False)]
    at_forward: list[str] = []  # the dtype of each fp32 unit's weight when it computes
    for unit in fp32_units:
        unit.register_forward_pre_hook(lambda m, _: at_forward.append(str(m.weight.dtype)))
    counter = None
    if trainer.dispatchers:
        ep_rank = trainer.meshes.ep.get_local_rank()
        counter = RemoteAssignmentCounter(
            model, cfg.parallel.ep, ep_rank, num_experts_of(cfg.model.args)
        )
    grads: set[str] = set()  # as the optimizer steps with them
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.update(str(_local(p.grad).dtype) for p in model.parameters())
    )
    trainer.steps.train_step(trainer.next_micro_batches())
    if counter is not None:
        counter.remote = 0
    # rank 0's record stands for all (the other ranks run the same step, unprofiled)
    profiling = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with profiling if rank == 0 else contextlib.nullcontext():
        record = trainer.steps.train_step(trainer.next_micro_batches())
    # Rows a rank sends and receives differ; summed over the ranks, each remote assignment
    # crosses four times (dispatch and combine, forward and backward).
    sent = [None] * world
    dist.all_gather_object(sent, (record.get("a2a_bytes"), counter.remote if counter else None))
    if rank != 0:
        return
    profiling.export_chrome_trace(f"{out}.trace")
    with open(f"{out}.trace") as f:
        events = json.load(f)["traceEvents"]
    ops, gathers = Counter(), Counter()
    for e in events:
        types = e.get("args", {}).get("Input type")
        if types is not None:
            ops[(e["name"], tuple(t for t in types if t not in NOT_TENSORS))] += 1
        if e.get("name") == "c10d::_allgather_base_":  # (output, input, ...): the shard's size
            numel = torch.Size(e["args"]["Input Dims"][1]).numel()
            gathers[(types[1], numel)] += 1
    state = [str(v.dtype) for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
    summary = {
        "ops": [[name, list(types), n] for (name, types), n in ops.items()],
        "all_gathers": [[dtype, numel, n] for (dtype, numel), n in gathers.items()],
        "master": sorted({str(_local(p).dtype) for p in model.parameters()}),
        "grads": sorted(grads),
        "optimizer_state": sorted(set(state)),
        "buffers": {n: str(b.dtype) for n, b in model.named_buffers()},
        "fp32_units": len(fp32_units),
        "fp32_unit_weight_at_forward": sorted(set(at_forward)),
        "fp32_shard_numels": sorted({_local(m.weight).numel() for m in fp32_units}),
        "a2a_bytes": sum(b for b, _ in sent) if counter else None,
        "remote_rows": sum(r for _, r in sent) if counter else None,
        "hidden": getattr(cfg.model.args, "hidden_size", None),
    }
    with open(out, "w") as f:
        json.dump(summary, f)


def _ops(summary: dict, name: str) -> Counter:
    """{input dtypes: calls} of the op `name` in the profiled step."""
    return Counter({tuple(t): n for op, t, n in summary["ops"] if op == name})


def _run_dtypes(argv: list[str], tmp_path) -> dict:
    out = str(tmp_path / "dtypes.json")
    run_distributed(dtype_worker, 4, argv + BF16, out)
    return json.loads(open(out).read())


@pytest.mark.slow
def test_what_is_bf16_and_what_stays_fp32_cp2_ep2(tmp_path):
    s = _run_dtypes(TINY + ["--parallel.cp=2", "--parallel.ep=2"], tmp_path)
    # FSDP2's policy as run: fp32 shards, gradients and Adam state; bf16 all-gathers except
    # the fp32 units (the routers), told apart by their shards' sizes; fp32 reduce-scatter.
    assert s["master"] == s["grads"] == s["optimizer_state"] == ["torch.float32"]
    gathered = {
        dtype: {numel for d, numel, _ in s["all_gathers"] if d == dtype} for dtype in (BF, F32)
    }
    assert gathered[BF] and gathered[F32] and gathered[F32] <= set(s["fp32_shard_numels"])
    assert s["fp32_units"] > 0 and s["fp32_unit_weight_at_forward"] == ["torch.float32"]
    assert set(_ops(s, "c10d::_reduce_scatter_base_")) == {(F32, F32)}
    assert {t for t in _ops(s, "gloo:all_reduce")} <= {(F32,), ("long int",)}
    # Expert parallelism: bf16 token rows (int64 counts), half the fp32 bytes for the same
    # routing, and the routing weights in fp32 (out, and their gradient back); the grouped
    # GEMM takes bf16.
    assert set(_ops(s, "moetrain::all_to_all")) == {(BF,), (F32,), ("long int",)}
    assert s["a2a_bytes"] == 4 * s["remote_rows"] * s["hidden"] * 2 + 8 * s["remote_rows"] > 0
    assert set(_ops(s, "aten::_grouped_mm")) == {(BF, BF, "int")}
    # The ring: bf16 q/k/v and K/V blocks, bf16 block kernels; the merged output is fp32
    # (its gradient arrives in fp32) and the dK/dV partial sums travel in fp32.
    assert set(_ops(s, "moetrain::ring_attention")) == {(BF, BF, BF)}
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert set(_ops(s, flash)) == {(BF, BF, BF)}
    assert set(_ops(s, f"{flash}_backward")) == {(BF,) * 5 + (F32,)}  # dO q k v O, LSE fp32
    grad_in = _ops(s, "GeneratedBackwardFor_moetrain_ring_attention_defaultBackward")
    assert set(grad_in) == {(F32,)}
    assert set(_ops(s, "gloo:send")) == {(BF,), (F32,)}
    # RMSNorm (every norm of the model, q/k norms included) normalises in fp32.
    assert set(_ops(s, "aten::rsqrt")) == {(F32,)}
    # The loss: log-softmax over fp32 logits, forward and backward.
    assert set(_ops(s, "aten::_log_softmax")) == {(F32,)}
    assert set(_ops(s, "aten::_log_softmax_backward_data")) == {(F32, F32)}


@pytest.mark.slow
def test_hsdp_reduces_in_fp32_and_routing_state_stays_fp32(tmp_path):
    # DeepSeek-V3: group-limited router (fp32 unit) and its correction bias (a buffer).
    hsdp = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"]
    s = _run_dtypes(TINY_DSV3 + hsdp, tmp_path)
    assert s["master"] == s["grads"] == s["optimizer_state"] == ["torch.float32"]
    bias = [d for n, d in s["buffers"].items() if n.endswith("e_score_correction_bias")]
    assert bias and set(bias) == {"torch.float32"}
    assert s["fp32_units"] > 0 and s["fp32_unit_weight_at_forward"] == ["torch.float32"]
    assert set(_ops(s, "c10d::_reduce_scatter_base_")) == {(F32, F32)}
    reduced = {t for t in _ops(s, "gloo:all_reduce")}
    assert (F32,) in reduced and reduced <= {(F32,), ("long int",)}  # the replicas' sum too
    assert set(_ops(s, "moetrain::all_to_all")) == {(BF,), (F32,), ("long int",)}
    assert s["a2a_bytes"] == 4 * s["remote_rows"] * s["hidden"] * 2 + 8 * s["remote_rows"] > 0


# --- layouts agree in bf16 ----------------------------------------------------------------

STEPS = 12
# The debug configs, smaller per step (12 steps of each model on four layouts in CI time:
# the loss falls to 0.62 of its first value by then, in both models),
# at an lr whose bf16 curve is smooth: at the configs' own 3e-3 and this batch, bf16 runs
# spike now and then, and when depends on reduction order (docs: "bf16 mixed precision").
SMALL = ["--data.seq_len=64", "--data.max_tokens=200000", "--train.global_batch_size=8",
         "--train.micro_batch_size=4", "--train.lr=1e-3", "--train.warmup_steps=2",
         "--metrics.jsonl=false", "--metrics.progress=false", *BF16]  # fmt: skip
# Qwen3-MoE (softmax top-k routing, a dense first block) and DeepSeek-V3 (MLA, group-limited
# sigmoid routing with its fp32 bias, a shared expert, MTP): the two routing and attention
# paths the layouts shard differently. (OLMoE, another softmax top-k router, added a third
# of this test's time and no path the layouts shard otherwise; its fp32 layouts:
# tests/test_model_layouts.py.)
MODELS = {m: [f"--config=configs/debug_{m}.toml", *SMALL] for m in ("qwen3_moe", "deepseek_v3")}
ONE_RANK = {"one": [], "one_mb2": ["--train.micro_batch_size=2"]}  # reduction order only
# NOTE: plain FSDP and plain EP are inside cp2 (FSDP over the cp ranks) and cp2_ep2; this
# test was a sixth of the suite's time with them on their own.
LAYOUTS = {
    "hsdp2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
    "cp2": ["--parallel.cp=2"],
    "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"],
    "pp2": ["--parallel.pp=2"],  # bf16 hidden states between stages
}


def losses_worker(rank: int, world: int, runs: dict[str, list[str]], out: str) -> None:
    """Each run's STEPS losses, one run after the other on the same ranks."""
    losses = {}
    for name, argv in runs.items():
        _, trainer = build_trainer(argv, world)
        losses[name] = [
            trainer.steps.train_step(trainer.next_micro_batches())["loss"] for _ in range(STEPS)
        ]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


def _runs(layouts: dict[str, list[str]]) -> dict[str, list[str]]:
    return {
        f"{m}/{name}": argv + extra for m, argv in MODELS.items() for name, extra in layouts.items()
    }


U_BF16, U_FP32 = 2.0**-8, 2.0**-24  # unit roundoff: the largest relative rounding error


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """x's norm-wise relative error against ref."""
    return ((x.float() - ref).norm() / ref.norm()).item()


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_layouts_agree_with_one_rank_in_bf16(tmp_path):
    run_distributed(losses_worker, 1, _runs(ONE_RANK), str(tmp_path / "one.json"))
    run_distributed(losses_worker, 2, _runs(LAYOUTS), str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    report = {}
    for m, argv in MODELS.items():
        ref = one[f"{m}/one"]
        # The same run with only the accumulation's grouping changed: what bf16 rounding in a
        # different order does to the curve, without any parallel code (under the micro_batch
        # aux loss, Qwen3's, also that loss's grouping: a change as small).
        spread = _max_rel(one[f"{m}/one_mb2"], ref)
        report[m] = {"reduction_order": spread, "step1": 0.0}
        step1 = _step1_bound(argv)
        for name in LAYOUTS:
            ours = two[f"{m}/{name}"]
            report[m][name] = _max_rel(ours, ref)
            report[m]["step1"] = max(report[m]["step1"], abs(ours[0] - ref[0]))
            assert abs(ours[0] - ref[0]) <= step1, (m, name, ours[0], ref[0], step1)
            assert ours[-1] < 0.7 * ours[0], (m, name)  # it trains
    print(json.dumps(report, indent=1))
    for m, row in report.items():
        for name in LAYOUTS:
            # Of the order of what reduction order alone does on one rank. Both are one rank's
            # curve under another pattern of bf16 rounding: the CPU sets the size of both,
            # not their ratio, so the bound is a multiple of the spread and no fixed figure
            # (a 1% cap here, one CPU's measure, was not). Measured: at most 1.4x on an AVX2
            # EPYC (2.4e-3, OLMoE on cp 2 x ep 2), 2.3x on an AVX-512 machine (5.2e-3,
            # DeepSeek-V3 on cp 2), 3.3x on other data; 10x leaves room for the spread's own
            # noise, and the floor of 1e-4 for a spread that happens to be small.
            assert row[name] <= 10 * max(row["reduction_order"], 1e-4), (m, name, row)


def _step1_bound(argv: list[str]) -> float:
    """How far two layouts' step-1 losses (the same weights) may be apart in bf16.

    A logit is off by sqrt(N) u of the logits' scale (N = 20 L + 2 roundings along the
    depth; see the Hugging Face comparison below), which at init is initializer_range *
    sqrt(hidden) (a unit-rms hidden state into N(0, initializer_range^2) weights). A token's
    loss moves by about one logit's error (its gradient is softmax - onehot), the mean over
    T tokens by 1/sqrt(T) of that, and two independent sides by sqrt(2) more. For the debug
    configs 5.0e-4 (5.6e-4 with DeepSeek-V3's MTP layer), 9e-5 of the loss at init; measured
    on an AVX2 EPYC at most 2.2e-5 (Qwen3-MoE).
    """
    cfg = load_config(argv)
    args = cfg.model.args
    depth = args.num_hidden_layers + getattr(args, "num_nextn_predict_layers", 0)
    logits = args.initializer_range * args.hidden_size**0.5
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return (2 * (20 * depth + 2)) ** 0.5 * U_BF16 * logits / tokens**0.5
