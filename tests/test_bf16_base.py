"""LoRA with the frozen base held in bf16 (`peft.base_dtype=bf16`, docs/finetuning.md "LoRA").

Under bf16 mixed precision FSDP rounds every fp32 weight to bf16 for compute, except the
plan's fp32 modules (routers), which the bf16 base keeps in fp32: so the bf16 base computes
what the fp32 base does, bit for bit, while holding half the bytes. Under fp32 compute the
base's rounding shows in the loss, within the bf16 bound of tests/test_bf16.py. On EP 2 it
trains as on one rank, by the measure test_bf16 uses for bf16 layouts. Saved with the
checkpoint (checkpoint.save_frozen=true), the base stays bf16 and a resume is exact.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from moetrain.models.common.lora import is_adapter
from moetrain.parallelisms.plan import match_modules
from tests.distributed import run_distributed, run_train
from tests.parity import build_trainer
from tests.test_bf16 import BF16, MODELS, STEPS, _local, _max_rel, _step1_bound, losses_worker
from tests.test_lora import LORA_RUN

LORA = ["--peft.method=lora", "--peft.rank=4"]
BF16_BASE = [*MODELS["qwen3_moe"], *LORA, "--peft.base_dtype=bf16"]
FP32_BASE = [*MODELS["qwen3_moe"], *LORA]
BF16_EP2 = [*BF16_BASE, "--parallel.ep=2"]
FP32 = "--train.mixed_precision=fp32"  # after the bf16 of MODELS: the later flag wins
(BF16_MP,) = BF16


def ep2_worker(rank: int, world: int, argv: list[str], out: str) -> None:
    """The losses, and the dtypes the model and the optimizer hold after them."""
    cfg, trainer = build_trainer(argv, world)
    losses = [trainer.steps.train_step(trainer.next_micro_batches())["loss"] for _ in range(STEPS)]
    fp32 = match_modules(trainer.model, trainer.spec.plan.fp32_modules, "fp32_modules")
    routers = {id(p) for _, module in fp32 for p in module.parameters()}
    held: dict[str, set] = {"adapters": set(), "routers": set(), "base": set(), "state": set()}
    for name, p in trainer.model.named_parameters():
        kind = "adapters" if is_adapter(name) else "routers" if id(p) in routers else "base"
        held[kind].add(str(_local(p).dtype))
        state = trainer.optimizer.state.get(p, {})
        held["state"].update(str(v.dtype) for v in state.values() if v.numel() > 1)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "held": {k: sorted(v) for k, v in held.items()}}, f)


@pytest.mark.slow
def test_a_bf16_base_computes_as_the_fp32_base_and_trains_on_ep2_as_on_one_rank(tmp_path):
    one = {
        "fp32_base": FP32_BASE,
        "bf16_base": BF16_BASE,
        "bf16_base_mb2": [*BF16_BASE, "--train.micro_batch_size=2"],  # reduction order only
        "fp32_base_fp32": [*FP32_BASE, FP32],
        "bf16_base_fp32": [*BF16_BASE, FP32],
    }
    run_distributed(losses_worker, 1, one, str(tmp_path / "one.json"))
    run_distributed(ep2_worker, 2, BF16_EP2, str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    f32, bf = "torch.float32", "torch.bfloat16"
    assert two["held"] == {"adapters": [f32], "routers": [f32], "base": [bf], "state": [f32]}
    ref = one["bf16_base"]
    # bf16 compute: the weights FSDP gathers are the same bf16 values either way.
    assert ref == one["fp32_base"]
    # fp32 compute: the base's one rounding per weight moves each logit by far less than
    # test_bf16's bound, which covers every matmul's input and output rounded in bf16 on
    # both sides; so that bound holds for this one-sided rounding of the weights alone.
    bound = _step1_bound(BF16_BASE)
    fp32_gap = abs(one["bf16_base_fp32"][0] - one["fp32_base_fp32"][0])
    assert fp32_gap <= bound, (fp32_gap, bound)
    ours = two["losses"]
    spread = _max_rel(one["bf16_base_mb2"], ref)
    print(json.dumps({"fp32_compute_step1": fp32_gap, "bound": bound, "reduction_order": spread,
                      "ep2": _max_rel(ours, ref), "ep2_step1": abs(ours[0] - ref[0])}))  # fmt: skip
    assert abs(ours[0] - ref[0]) <= bound
    assert _max_rel(ours, ref) <= 10 * max(spread, 1e-4)  # as test_bf16's layouts
    assert ours[-1] < ours[0]  # the adapters train


@pytest.mark.slow
def test_a_bf16_base_saved_with_the_checkpoint_resumes_exactly_and_exports(tmp_path):
    """checkpoint.save_frozen=true: the base is saved in bf16 (the routers in fp32), a
    resume from it repeats the uninterrupted run, and the export reads it into fp32."""
    from moetrain.checkpoint.whole_model import load_checkpoint_model

    run = [*LORA_RUN, "--peft.base_dtype=bf16", "--checkpoint.save_frozen=true", BF16_MP]
    straight = run_train(run, tmp_path / "straight", nproc=2)
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step-2",
        tmp_path / "resumed" / "checkpoints" / "step-2",
    )
    resumed = run_train(run, tmp_path / "resumed", nproc=2)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    step = tmp_path / "straight" / "checkpoints" / "step-4"
    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    base = {k: v.properties.dtype for k, v in saved.items() if k.startswith("model.")}
    base = {k: d for k, d in base.items() if not is_adapter(k) and "correction_bias" not in k}
    assert {k for k, d in base.items() if d == torch.float32} == {
        k for k in base if k.endswith("mlp.gate.weight")
    }  # the routers, fp32 as in training
    assert sum(d == torch.bfloat16 for d in base.values()) > len(base) / 2
    model, _, _ = load_checkpoint_model(str(step))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
