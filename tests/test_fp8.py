"""FP8 GEMMs (`train.fp8`): the arithmetic against an fp32 emulation of the same rounding,
what the plan puts in FP8, the refusals, and training against bf16 within FP8's rounding
bound. Layouts: tests/test_layout_parity.py (its `_fp8` rows); the cp rule, compile and
checkpoints: tests/test_fp8_runs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.build.float8 import apply_float8, fp8_device_problem
from moetrain.config import ConfigError, load_config
from moetrain.models import get_model_spec
from moetrain.models.common.float8 import E4M3, E5M2, Float8Linear, float8_linear, quantize
from moetrain.models.common.float8_experts import Float8GroupedExperts, fp8_grouped_mm
from moetrain.models.common.moe import MoEOptions
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, build_trainer

U_E4M3 = 2.0**-4  # e4m3's unit roundoff: 3 mantissa bits


def _deq(t: torch.Tensor, dtype: torch.dtype, dim) -> torch.Tensor:
    """t rounded as the FP8 path rounds it, back in fp32 (the emulation's operand)."""
    q, scale = quantize(t, dtype, dim)
    return q.float() * scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_scales_are_powers_of_two_that_keep_the_amax_in_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g) * torch.logspace(-6, 6, 6)[:, None]
    for dtype in (E4M3, E5M2):
        q, scale = quantize(x, dtype, -1)
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5)  # a power of two: x / scale is exact
        top = x.abs().amax(-1, keepdim=True) / scale
        limit = torch.finfo(dtype).max
        assert torch.all(top <= limit) and torch.all(top > limit / 2)  # the largest such
        # Every element is its value rounded once to the format (within half a step).
        err = (q.float() * scale - x).abs() / x.abs()
        assert err.max() <= (2.0**-4 if dtype == E4M3 else 2.0**-3)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_linear_is_the_fp32_product_of_its_rounded_operands(recipe):
    """Forward, input gradient and weight gradient against fp32 GEMMs of the operands
    rounded by hand (the recipe of moetrain/models/common/float8.py); and FP8's own error
    against the unrounded product is what one rounding of each operand gives."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 32, generator=g, requires_grad=True)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    bias = torch.randn(48, generator=g)
    dy = torch.randn(4, 8, 48, generator=g)
    y = float8_linear(x, w, bias, recipe)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x2, dy2 = x.detach().reshape(-1, 32), dy.reshape(-1, 48)
    if recipe == "rowwise":
        ref = _deq(x2, E4M3, -1) @ _deq(w.detach(), E4M3, -1).t()
        ref_dx = _deq(dy2, E4M3, -1) @ _deq(w.detach().t(), E4M3, -1).t()
        ref_dw = dy2.t() @ x2  # the weight gradient in the compute dtype
    else:
        ref = _deq(x2, E4M3, None) @ _deq(w.detach(), E4M3, None).t()
        ref_dx = _deq(dy2, E5M2, None) @ _deq(w.detach(), E4M3, None)
        ref_dw = _deq(dy2, E5M2, None).t() @ _deq(x2, E4M3, None)
    assert _rel(y.reshape(-1, 48), ref + bias) <= 1e-6
    assert _rel(dx.reshape(-1, 32), ref_dx) <= 1e-6
    assert _rel(dw, ref_dw) <= 1e-6
    # Each operand rounded once: relative error <= u each, so about 2u at most in the
    # product (e5m2's gradients: u = 2^-3).
    u_grad = U_E4M3 if recipe == "rowwise" else 2.0**-3
    assert 0 < _rel(y.detach(), float(1) * (x.detach() @ w.detach().t() + bias)) <= 2 * U_E4M3
    assert 0 < _rel(dx, dy @ w.detach()) <= U_E4M3 + u_grad


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_experts_are_one_fp32_gemm_per_expert_of_rounded_operands(recipe):
    """The experts' op (one `_scaled_mm` per expert on CPU), an expert without tokens
    included, against fp32 GEMMs of rows rounded one by one and weights rounded per
    channel (rowwise) or per expert (tensorwise); its fake kernel and autograd against the
    real ones (`opcheck`)."""
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(4, 48, 32, generator=g, requires_grad=True)  # nn.Linear's [E, out, in]
    dy = torch.randn(16, 48, generator=g)
    y = fp8_grouped_mm(x, w.transpose(-2, -1), counts, recipe)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dim = -1 if recipe == "rowwise" else (-2, -1)
    rows = torch.split(torch.arange(16), counts.tolist())
    xq, dyq = _deq(x.detach(), E4M3, -1), _deq(dy, E4M3, -1)
    wq = _deq(w.detach(), E4M3, dim)  # per output channel, or per expert
    wtq = _deq(w.detach().transpose(-2, -1), E4M3, dim)  # per input channel, or per expert
    ref = torch.cat([xq[r] @ wq[e].t() for e, r in enumerate(rows)])
    ref_dx = torch.cat([dyq[r] @ wtq[e].t() for e, r in enumerate(rows)])
    ref_dw = torch.stack([dy[r].t() @ x.detach()[r] for r in rows])
    assert _rel(y, ref) <= 1e-6 and _rel(dx, ref_dx) <= 1e-6 and _rel(dw, ref_dw) <= 1e-6
    assert torch.all(dw[1] == 0)  # the expert that got no rows
    torch.library.opcheck(fp8_grouped_mm, (x, w.transpose(-2, -1), counts, recipe))


def _linears(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("argv", [TINY, TINY_DSV3], ids=["qwen3_moe", "deepseek_v3"])
def test_the_plans_block_gemms_go_fp8_and_the_rest_stays(argv):
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    plain = spec.build(cfg.model.args, MoEOptions())
    model = spec.build(cfg.model.args, MoEOptions())
    params = {n: p for n, p in model.named_parameters()}
    apply_float8(model, spec.plan, "rowwise", cfg.model.name)
    # The same Parameters under the same names: checkpoints and HF I/O see the model.
    assert {n: p for n, p in model.named_parameters()} == params
    assert model.state_dict().keys() == plain.state_dict().keys()
    kinds = _linears(model)
    fp8 = sorted(n for n, k in kinds.items() if k is Float8Linear)
    kept = sorted(n for n, k in kinds.items() if k is nn.Linear)
    assert all(n.startswith(("layers.", "mtp.")) for n in fp8)
    assert any(n.endswith("self_attn.o_proj") for n in fp8)
    assert any(".mlp.down_proj" in n for n in fp8)  # the dense layer's MLP
    # The head and (DeepSeek-V3) a projection of 20 outputs (not a multiple of 16) stay.
    assert "lm_head" in kept and all(
        n == "lm_head" or n.endswith("kv_a_proj_with_mqa") for n in kept
    )
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert routers and not any(isinstance(m, Float8Linear) for m in routers)
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(isinstance(m, Float8GroupedExperts) for m in experts)
    if cfg.model.name == "deepseek_v3":
        assert "mtp.0.eh_proj" in fp8 and any(n.endswith("shared_experts.up_proj") for n in fp8)


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="train.fp8=rowwise with peft.method=lora"):
        load_config([*TINY, "--train.fp8=rowwise", "--peft.method=lora"])
    with pytest.raises(ConfigError, match="train.fp8=tensorwise with parallel.cp=2"):
        load_config(
            [
                *TINY,
                "--train.fp8=tensorwise",
                "--parallel.cp=2",
                "--train.activation_checkpoint=selective",
            ]
        )
    with pytest.raises(ConfigError, match="train.fp8"):
        load_config([*TINY, "--train.fp8=e4m3"])
    gpt_oss = get_model_spec("gpt_oss")
    cfg = load_config(["--config=configs/debug_gpt_oss.toml"])
    with pytest.raises(ConfigError, match="train.fp8=rowwise: model 'gpt_oss'"):
        apply_float8(
            gpt_oss.build(cfg.model.args, MoEOptions()), gpt_oss.plan, "rowwise", "gpt_oss"
        )
    bf16 = torch.bfloat16
    a100 = fp8_device_problem("rowwise", "cuda", (8, 0), bf16, False)
    assert "compute capability 8.9" in a100 and "train.fp8=none" in a100
    # Ada runs dense FP8 GEMMs but not the grouped one the routed experts need.
    assert fp8_device_problem("rowwise", "cuda", (8, 9), bf16, False) is None
    assert "9.0" in fp8_device_problem("tensorwise", "cuda", (8, 9), bf16, True)
    assert "train.mixed_precision" in fp8_device_problem(
        "rowwise", "cuda", (9, 0), torch.float32, True
    )
    missing = fp8_device_problem("rowwise", "cuda", (9, 0), bf16, True, torch_ops={"_scaled_mm"})
    assert "torch._scaled_grouped_mm" in missing and "train.fp8=rowwise" in missing
    assert fp8_device_problem("rowwise", "cpu", None, torch.float32, True) is None  # this torch


def _first_grads(trainer) -> dict:
    """The gradients the optimizer's first step gets (filled by a pre-step hook)."""
    grads: dict = {}

    def keep(*_) -> None:
        if not grads:
            grads.update({n: p.grad.float().clone() for n, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(keep)
    return grads


def _fp8_vs_bf16_worker(rank: int, world: int, runs: dict[str, list[str]], steps: int, out: str):
    """Each run's per-step losses and its first step's gradients, one run after another."""
    result = {}
    for name, argv in runs.items():
        _, trainer = build_trainer(argv, world)
        grads = _first_grads(trainer)
        batches = (trainer.next_micro_batches() for _ in range(steps))
        losses = [trainer.steps.train_step(b)["loss"] for b in batches]
        result[name] = {"losses": losses, "grads": grads}
    torch.save(result, out)


@pytest.mark.slow
def test_fp8_trains_as_bf16_does_within_fp8s_rounding(tmp_path):
    """6 steps of the tiny Qwen3-MoE (rowwise) and DeepSeek-V3 (tensorwise) in bf16
    compute, with and without FP8. Bounds from e4m3's unit roundoff u = 2^-4
    (docs/parallelisms.md, "FP8 training"): every GEMM input rounded once more, by at most
    u of itself, so the first step's gradient (the same weights on both sides) is off by at
    most about 2u; each step's loss within u of bf16's; and FP8 learns: its loss falls at
    least 90% as far as bf16's. Not equal to bf16: FP8 really ran."""
    steps = 6
    common = ["--train.mixed_precision=bf16", "--train.lr=1e-3"]
    cases = {"qwen3": (TINY, "rowwise"), "dsv3": (TINY_DSV3, "tensorwise")}
    runs = {
        f"{model}_{recipe}": [*argv, *common, f"--train.fp8={recipe}"]
        for model, (argv, fp8) in cases.items()
        for recipe in ("none", fp8)
    }
    run_distributed(_fp8_vs_bf16_worker, 1, runs, steps, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    for model, (_, recipe) in cases.items():
        bf16, fp8 = out[f"{model}_none"], out[f"{model}_{recipe}"]
        flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
        grad_err = _rel(flat(fp8["grads"]), flat(bf16["grads"]))
        print(
            f"{model} {recipe}: step-1 gradient off by {grad_err:.3e}; losses "
            f"{fp8['losses']} against bf16's {bf16['losses']}"
        )
        assert 0 < grad_err <= 2 * U_E4M3
        for a, b in zip(fp8["losses"], bf16["losses"], strict=True):
            assert abs(a - b) <= U_E4M3 * b
        assert fp8["losses"] != bf16["losses"]
        fell = bf16["losses"][0] - bf16["losses"][-1]
        assert fell > 0 and fp8["losses"][0] - fp8["losses"][-1] >= 0.9 * fell
