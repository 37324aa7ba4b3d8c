"""FP8 (`train.fp8`) across ranks, compile and checkpoints: the tensorwise amax rule over
context-parallel ranks, compiled blocks against eager ones, and checkpoints that stay in
the master dtype (an FP8 run resumes in bf16 and back). Arithmetic and targets:
tests/test_fp8.py; layouts: tests/test_layout_parity.py."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moetrain.config import load_config
from moetrain.models import get_model_spec
from moetrain.models.common.float8 import E4M3, E5M2, float8_linear, quantize
from tests.distributed import run_distributed, run_train
from tests.test_bf16_checkpoints import loaded_worker


def _cp_amax_worker(rank: int, world: int, out: str) -> None:
    """Each rank holds half of every sequence (as context parallelism cuts them); the first
    half's values are 2^16 times the second's, so a scale taken from one rank's half alone
    differs from one process's (scales are powers of two: a finer one changes what e4m3
    rounds only for values it would otherwise leave below its normal range, 2^-6 of 448,
    which is why the halves differ so much here). Saves what each rank computed, with and without the
    group's amax, and the one-process results."""
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, 32, generator=g), torch.randn(48, 32, generator=g)
    dy = torch.randn(2, 16, 48, generator=g)
    x[:, 8:] *= 2.0**-16
    dy[:, :8] *= 2.0**-32  # e5m2 spans 2^30: further apart
    part = slice(8 * rank, 8 * rank + 8)
    group = dist.group.WORLD
    result = {}
    for name, amax_group in (("group", group), ("local", None)):
        xl = x[:, part].clone().requires_grad_()
        wl = w.clone().requires_grad_()
        y = float8_linear(xl, wl, None, "tensorwise", amax_group)
        dx, dw = torch.autograd.grad(y, (xl, wl), dy[:, part])
        dist.all_reduce(dw)  # the weight's gradient: the ranks' parts summed
        scales = (
            quantize(xl, E4M3, None, amax_group)[1],
            quantize(dy[:, part], E5M2, None, amax_group)[1],
        )
        result[name] = {"y": y.detach(), "dx": dx, "dw": dw, "scales": scales}
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = float8_linear(xf, wf, None, "tensorwise")
    dx, dw = torch.autograd.grad(y, (xf, wf), dy)
    scales = (quantize(x, E4M3, None)[1], quantize(dy, E5M2, None)[1])
    result["one"] = {"y": y[:, part].detach(), "dx": dx[:, part], "dw": dw, "scales": scales}
    torch.save(result, f"{out}.{rank}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_tensorwise_scales_are_one_process_scales_over_the_cp_ranks(tmp_path):
    run_distributed(_cp_amax_worker, 2, str(tmp_path / "out"))
    for rank in range(2):
        r = torch.load(tmp_path / f"out.{rank}")
        one, group, local = r["one"], r["group"], r["local"]
        assert all(torch.equal(a, b) for a, b in zip(group["scales"], one["scales"], strict=True))
        for key in ("y", "dx", "dw"):
            assert _rel(group[key], one[key]) <= 1e-6, (rank, key)
        # The control: from its own half alone, the half of small values (rank 1's x,
        # rank 0's dy) gets a finer scale than one process's, and rounds otherwise.
        assert not torch.equal(local["scales"][1 - rank], one["scales"][1 - rank])
        assert _rel(local["y" if rank else "dx"], one["y" if rank else "dx"]) > 1e-3


@pytest.mark.slow
def test_compiled_fp8_linears_compute_what_eager_ones_do():
    """`float8_linear` compiled by inductor on CPU (as a compiled block traces it: the
    quantisation's amax, power-of-two scale, clamp and cast become generated code, the
    GEMMs extern calls), forward and both gradients, against eager: bit for bit, in both
    recipes. (The routed experts' FP8 GEMM is one opaque op: `opcheck` in
    tests/test_fp8.py.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    dy = torch.randn(64, 48, generator=g)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for recipe in ("rowwise", "tensorwise"):
        outs = []
        for fn in (float8_linear, torch.compile(float8_linear, backend="inductor")):
            y = fn(x, w, None, recipe)
            outs.append((y, *torch.autograd.grad(y, (x, w), dy)))
        for eager, compiled in zip(*outs, strict=True):
            assert torch.equal(eager, compiled), recipe
    # compiled whole: one graph a recipe, no break back to eager
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


CKPT = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--model.num_hidden_layers=2",
    "--data.seq_len=64",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=2",
    "--metrics.log_interval=1",
    "--train.warmup_steps=1",
    "--checkpoint.interval=1",
]


@pytest.mark.slow
def test_fp8_checkpoints_hold_the_master_weights_and_resume_in_bf16_and_back(tmp_path):
    """A rowwise FP8 run saves step 2; a bf16 run without FP8 resumes it and saves step 3;
    a tensorwise FP8 run resumes that. Each checkpoint holds fp32 masters under the plain
    model's names, and each resume starts from exactly their bits."""
    fp8 = run_train([*CKPT, "--train.steps=2", "--train.fp8=rowwise"], tmp_path / "fp8")
    assert [r["step"] for r in fp8] == [1, 2]
    step2 = tmp_path / "fp8" / "checkpoints" / "step-2"
    shutil.copytree(step2, tmp_path / "bf16" / "checkpoints" / "step-2")
    bf16 = ["--train.mixed_precision=bf16", "--train.fp8=none"]
    resumed = run_train([*CKPT, "--train.steps=3", *bf16], tmp_path / "bf16")
    assert [r["step"] for r in resumed] == [3]
    step3 = tmp_path / "bf16" / "checkpoints" / "step-3"
    cfg = load_config(CKPT)
    names = set(get_model_spec("qwen3_moe").build(cfg.model.args).state_dict())
    loads = {
        "bf16": ([*CKPT, *bf16, f"--checkpoint.resume={step2}"], step2),
        "fp8": ([*CKPT, "--train.fp8=tensorwise", f"--checkpoint.resume={step3}"], step3),
    }
    for name, (argv, step_dir) in loads.items():
        dcp_to_torch_save(step_dir, tmp_path / f"{name}.pt")
        master = torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
        assert set(master) == names  # no FP8 state: scales are computed, never kept
        assert {t.dtype for t in master.values() if t.is_floating_point()} == {torch.float32}
        out = tmp_path / f"loaded_{name}.pt"
        argv = [*argv, f"--job.output_dir={tmp_path / ('load_' + name)}"]
        run_distributed(loaded_worker, 1, argv, str(out))
        loaded = torch.load(out)
        assert loaded and loaded.keys() <= master.keys()
        assert all(torch.equal(t, master[n]) for n, t in loaded.items())
