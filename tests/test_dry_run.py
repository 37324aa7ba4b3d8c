"""The dry-run planner (`python -m moetrain.planner`) against what real runs allocate."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest

from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "debug_qwen3_moe.toml")
# vocab 330 over 4 ranks does not split evenly: FSDP2's padding shows in the sizes.
UNEVEN = ["--model.vocab_size=330", "--parallel.ep=2"]
# The same in two pipeline stages (layers 0-1 | 2-3 and the head) of 2 ranks, 4 micro-batches.
STAGED = [*UNEVEN, "--parallel.pp=2", "--train.global_batch_size=32"]


def _dry_run(world_size: int, *overrides: str) -> dict:
    """The planner's JSON for the config at `world_size`, through its command line (in
    process: a fresh interpreter's imports cost more than most plans)."""
    from moetrain.planner.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        argv = [f"--world-size={world_size}", "--config", CONFIG, *overrides, "--json", out]
        assert main(argv) == 0, argv
        with open(out) as f:
            return json.load(f)


def _storage_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        t = t._local_tensor if isinstance(t, DTensor) else t
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _real_state_bytes(rank: int, world_size: int, layouts: list[list[str]], out: str) -> None:
    """One real step on gloo per layout: the bytes behind the parameters, gradients and
    optimizer state this rank really holds (distinct storages, padding included), and
    the bytes its point-to-point sends carry (pipeline stages), read from the profiler's
    events of the step (gloo's send ops, with their shapes and dtypes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moetrain.config import load_config
    from moetrain.loop.trainer import Trainer
    from moetrain.parallelisms.dims import ParallelDims

    found = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                ["--config", CONFIG, *overrides, f"--job.output_dir={tmp}",
                 "--metrics.jsonl=false", "--metrics.progress=false"]
            )  # fmt: skip
            trainer = Trainer(cfg, ParallelDims.of(cfg.parallel, 4))
            params = _storage_bytes(trainer.params)
            batches = trainer.next_micro_batches()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                trainer.forward_backward(batches)
            grads = _storage_bytes(q.grad for q in trainer.params)
            trainer.optimizer.step()
            state = [v for s in trainer.optimizer.state.values() for v in s.values()]
            optimizer = _storage_bytes(v for v in state if isinstance(v, torch.Tensor))
        # (kineto's events: torch 2.11's FunctionEvent has no input dtypes)
        sends = [e for e in prof.profiler.kineto_results.events() if e.name() == "gloo:send"]
        dtypes = {"float": torch.float32, "c10::BFloat16": torch.bfloat16}
        # NOTE: the hidden states and their gradients. The schedules also send 1-element
        # control messages at the first step (torch 2.13 an integer vote, 2.11 a float
        # warm-up to each neighbour): not data the planner sizes.
        sent = sum(
            math.prod(shape) * torch.empty(0, dtype=dtypes[dtype]).element_size()
            for e in sends
            for shape, dtype in zip(e.shapes(), e.dtypes(), strict=True)
            if dtype in dtypes and math.prod(shape) > 1
        )
        found.append({"rank": rank, "params": params, "grads": grads, "optimizer": optimizer,
                      "sent": sent})  # fmt: skip
    with open(f"{out}.{rank}", "w") as f:
        json.dump(found, f)


@pytest.mark.slow
def test_state_bytes_equal_a_real_4_rank_run():
    """The planner's per-rank state, and under pipeline stages its per-stage state and
    point-to-point bytes, against one real step of each layout (one launch)."""
    plain, staged = _dry_run(4, *UNEVEN), _dry_run(4, *STAGED)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bytes")
        run_distributed(_real_state_bytes, 4, [UNEVEN, STAGED], out)
        real = []
        for rank in range(4):
            with open(f"{out}.{rank}") as f:
                real.append(json.load(f))
    state = lambda r: {k: r[k] for k in ("rank", "params", "grads", "optimizer")}  # noqa: E731
    # (nothing frozen without LoRA: the planner's `frozen` bytes are 0)
    assert all(r.pop("frozen") == 0 for r in plain["per_rank"] + staged["per_rank"])
    assert plain["per_rank"] == [state(r[0]) for r in real]
    # the padding is really exercised: the last rank's optimizer state is smaller
    assert real[3][0]["optimizer"] < real[0][0]["optimizer"]
    # pipeline stages: the first stage (embedding, layers 0-1) on ranks 0-1, the second
    # (layers 2-3, norm, head) on ranks 2-3; each stage's shards as the planner has them
    assert staged["per_rank"] == [state(r[1]) for r in real]
    assert real[0][1]["params"] != real[2][1]["params"]
    assert [r[0]["sent"] for r in real] == [0] * 4  # no pipeline, no sends
    p2p = [q["p2p_bytes"] for q in staged["pipeline"]["pp_ranks"]]
    assert [r[1]["sent"] for r in real] == [p2p[0], p2p[0], p2p[1], p2p[1]]
    assert p2p[0] > 0


@pytest.mark.slow
def test_activation_estimate_within_15_percent_of_measured_peak():
    """The planner's step increase (activations, gradients, FSDP buffers) against the
    allocator's measured peak increase of a real CPU step (benchmarks/memory.py)."""
    bench = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--config", CONFIG, "--modes=none,full",
         "--warmup=1", "--measure=1"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    measured = json.loads(bench.stdout.splitlines()[0])["modes"]
    planned = _dry_run(1)["modes"]
    for mode in ("none", "full"):
        estimate = planned[mode]["step_increase_rank0"]
        real = measured[mode]["peak_mib"] * 2**20
        assert abs(estimate / real - 1) < 0.15, (mode, estimate / 2**20, real / 2**20)
    # and checkpointing is seen to save memory
    assert planned["full"]["activation_peak"] < planned["none"]["activation_peak"]


def test_refusals_of_a_real_launch_apply(capsys):
    # The first through `python -m` (the entry point itself), the others in process.
    run = subprocess.run(
        [sys.executable, "-m", "moetrain.planner", "--world-size=4", "--config", CONFIG,
         "--parallel.ep=16"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2
    assert "parallel.ep=16" in run.stderr and "Traceback" not in run.stderr
    from moetrain.planner.cli import main

    assert main(["--config", CONFIG]) == 2
    assert "--world-size" in capsys.readouterr().err
    # an ep group of 4 ranks straddling the planned nodes of 6 (12 ranks in all)
    argv = ["--world-size=12", "--config", CONFIG, "--parallel.ep=4"]
    argv += ["--train.global_batch_size=12", "--train.micro_batch_size=1", "--ranks-per-node=6"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "with 6 ranks per node" in err, err


def test_a_worker_count_is_a_count_and_belongs_to_a_search(capsys):
    from moetrain.planner.cli import main

    assert main(["--world-size=4", "--config", CONFIG, "--search", "--workers=some"]) == 2
    assert "--workers 'some'" in capsys.readouterr().err
    assert main(["--world-size=4", "--config", CONFIG, "--workers=2"]) == 2
    assert "add --search" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--world-size=0"],  # was a ZeroDivisionError (issue 52, item 12)
        ["--world-size=-2"],
        ["--world-size=1", "--ranks-per-node=0"],  # a ZeroDivisionError too
        ["--world-size=1", "--gpu-memory=-1"],  # was planned, and said to "fit"
        ["--world-size=1", "--gpu-memory=nan"],
        ["--world-size=1", "--gpu-tflops=0"],
        ["--world-size=1", "--efficiency=0"],
        ["--world-size=1", "--efficiency=1.5"],
        ["--world-size=1", "--intra-gbps=0"],
        ["--world-size=1", "--inter-gbps=-50"],
    ],
)
def test_a_count_or_figure_no_machine_has_is_refused_naming_the_flag(flags, capsys):
    from moetrain.planner.cli import main

    assert main([*flags, "--config", CONFIG]) == 2
    err = capsys.readouterr().err
    flag, _, value = flags[-1].partition("=")
    assert err.startswith(f"error: {flag} {value!r}: give ") and "Traceback" not in err


@pytest.mark.slow
def test_knob_suggestion_brings_the_layout_in():
    """A budget between the `full` and `none` peaks: the planner says it does not fit and
    names a checkpointing mode whose peak is under the budget."""
    plan = _dry_run(2, "--train.global_batch_size=8")
    none, full = plan["modes"]["none"]["peak_rank0"], plan["modes"]["full"]["peak_rank0"]
    budget = (none + full) / 2 / 2**30
    plan = _dry_run(
        2, "--train.global_batch_size=8", f"--gpu-memory={budget}", "--memory-reserve=0"
    )
    assert plan["fits"] is False
    (ac,) = [s for s in plan["suggestions"] if "activation_checkpoint" in s["flag"]]
    mode = ac["flag"].split("=")[1]
    assert mode in ("selective", "full")
    assert ac["peak"] == plan["modes"][mode]["peak_rank0"] <= budget * 2**30


def test_a_suggestion_is_never_a_flag_the_launch_would_refuse():
    """Under DualPipeV (split backward) `full` checkpointing is refused at launch: a budget
    only `full` would meet gets no suggestion of it, whatever its peak."""
    v = ["--parallel.pp=2", "--parallel.pp_schedule=DualPipeV", "--train.global_batch_size=16"]
    plan = _plan_in_process(2, CONFIG, *v)
    full, selective = (plan["modes"][m]["peak_rank0"] for m in ("full", "selective"))
    assert full < selective
    budget = f"--gpu-memory={(selective + full) / 2 / 2**30}"
    plan = _plan_in_process(2, CONFIG, *v, budget, "--memory-reserve=0")
    assert plan["fits"] is False
    assert not any("activation_checkpoint=full" in s["flag"] for s in plan["suggestions"])


def test_all_to_all_bytes_follow_the_routed_rows():
    """The planner's EP bytes, from the config alone: each rank's micro-batch of 4 x 128
    tokens takes top-2 experts in 3 MoE layers (layer 0 is dense), fp32 rows of 128; under
    balanced routing (ep-1)/ep of the rows leave, out and back, in forward and backward."""
    plan = _dry_run(4, "--parallel.ep=2")
    rows = 4 * 128 * 2 * 3
    expected = rows * 128 * 4 * (2 - 1) // 2 * 2 * 2
    assert plan["per_step"]["ep_all_to_all"] == expected
    assert plan["per_step"]["ep_all_to_all_full_ac"] == expected * 3 // 2  # + the replay


def _plan_in_process(world_size: int, config: str, *overrides: str) -> dict:
    from moetrain.planner.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        assert (
            main([f"--world-size={world_size}", "--config", config, *overrides, "--json", out]) == 0
        )
        with open(out) as f:
            return json.load(f)


def test_pipeline_stages_with_lora_plan_the_adapters_alone_as_trained():
    """pp with LoRA (stage 0's embedding, measured alone, trains nothing): the gradients
    are the adapters' fp32 bytes, counted from the LoRA model itself; the frozen base is
    in the parameters but neither in the gradients nor in the reduce-scatter."""
    import torch

    from moetrain.build.lora import apply_lora
    from moetrain.config import load_config
    from moetrain.models import get_model_spec

    lora = ["--parallel.pp=2", "--peft.method=lora"]
    plan = _plan_in_process(2, CONFIG, *lora)
    full = _plan_in_process(2, CONFIG, "--parallel.pp=2")
    cfg = load_config(["--config", CONFIG, *lora])
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
        apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in spec.build(cfg.model.args).parameters()
    )
    assert trained == adapters  # only the adapters train
    # one rank per stage: no shard padding, every stage's gradients on its own rank
    assert sum(r["grads"] for r in plan["per_rank"]) == 4 * trained
    assert (
        sum(r["params"] for r in plan["per_rank"])
        == sum(r["params"] for r in full["per_rank"]) + 4 * adapters
    )
    assert sum(r["grads"] for r in plan["per_rank"]) < sum(r["grads"] for r in full["per_rank"]) / 5
    assert plan["fsdp_gather"]["step"]["reduce_scatter"] == plan["per_rank"][1]["grads"]
    # Mixtral 8x7B, 2 stages of 8 ranks: plans, and reduces the adapters' gradients alone.
    mixtral = os.path.join(ROOT, "configs", "mixtral_8x7b.toml")
    big = _plan_in_process(16, mixtral, *lora)
    step = big["fsdp_gather"]["step"]
    assert 0 < step["reduce_scatter"] < step["all_gather"] / 100
    assert all(r["grads"] < r["params"] / 100 for r in big["per_rank"])


def test_a_bf16_lora_base_halves_the_frozen_bytes_and_says_so(capsys):
    """peft.base_dtype=bf16: the frozen weights at 2 bytes each, but the routers (fp32 under
    bf16, moetrain.build.lora.hold_frozen_base); the adapters' state unchanged. One rank: no
    shard padding, so the bytes are the parameters' exactly."""
    import torch

    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.plan import match_modules

    lora = ["--peft.method=lora"]
    fp32 = _plan_in_process(1, CONFIG, *lora)["per_rank"][0]
    bf16 = _plan_in_process(1, CONFIG, *lora, "--peft.base_dtype=bf16")["per_rank"][0]
    assert "the frozen base in bf16: ranks 0" in capsys.readouterr().out
    spec = get_model_spec(load_config(["--config", CONFIG]).model.name)
    with torch.device("meta"):
        model = spec.build(load_config(["--config", CONFIG]).model.args)
    routers = match_modules(model, spec.plan.fp32_modules, "fp32_modules")
    router_bytes = 4 * sum(p.numel() for _, m in routers for p in m.parameters())
    assert fp32["frozen"] == 4 * sum(p.numel() for p in model.parameters())
    assert bf16["frozen"] == (fp32["frozen"] - router_bytes) // 2 + router_bytes
    assert fp32["params"] - bf16["params"] == fp32["frozen"] - bf16["frozen"]
    assert (bf16["grads"], bf16["optimizer"]) == (fp32["grads"], fp32["optimizer"])
