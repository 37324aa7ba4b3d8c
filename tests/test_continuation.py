"""Training in stages (`checkpoint.init_from`): a stage 1 on 2 ranks, then a stage 2 on 4
ranks with EP 2, a longer data.seq_len, a blend and YaRN scaling; its weights are
stage 1's bits, its optimizer moments only when asked, and a stage 2 resumed mid-way is
exact. Shape changes, and a resume at another data.seq_len, are refused before work starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from tests.distributed import ROOT, run_distributed, run_train
from tests.parity import build_trainer
from tests.test_mixture import _mix, _refused, prepare_corpora

STAGE1 = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--data.seq_len=64",
    "--train.steps=2",
    "--train.warmup_steps=1",
    "--checkpoint.interval=2",
    "--metrics.log_interval=1",
]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    return prepare_corpora(tmp_path_factory.mktemp("mix"))


@pytest.fixture(scope="module")
def stage1(tmp_path_factory) -> Path:
    """Stage 1's job directory: 2 ranks (FSDP 2), checkpoint at step 2."""
    out = tmp_path_factory.mktemp("stage1") / "job"
    run_train(STAGE1, out, nproc=2)
    return out


def _stage2(corpora, job: Path, out: Path, optimizer: bool = True) -> list[str]:
    return [
        "--config=configs/debug_qwen3_moe.toml",
        "--data.source=tokens",
        "--data.max_tokens=none",
        "--data.seq_len=128",  # twice stage 1's
        # A context extension's RoPE: YaRN over stage 1's length (no shape changes).
        "--model.rope_type=yarn",
        "--model.rope_factor=2",
        "--model.rope_original_max_position_embeddings=64",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--train.steps=4",
        "--train.warmup_steps=1",
        "--parallel.ep=2",
        "--checkpoint.interval=2",
        f"--checkpoint.init_from={job}",  # the job's directory: its newest checkpoint
        f"--checkpoint.init_optimizer={str(optimizer).lower()}",
        f"--job.output_dir={out}",
        "--metrics.progress=false",
        _mix(corpora, {"web": 0.5, "code": 0.5}),
    ]


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _stage2_worker(rank: int, world: int, argv: list[str], fresh: list[str], out: str) -> None:
    _, trainer = build_trainer(fresh, world)  # checkpoint.init_optimizer=false
    assert len(trainer.optimizer.state) == 0, "the optimizer should start fresh"
    del trainer
    cfg, trainer = build_trainer(argv, world)
    assert trainer.state.step == 0 and any(
        "rope_type: 'default' -> 'yarn'" in n for n in trainer.notes
    )
    assert trainer.model.yarn is not None
    # Copies: the optimizer steps its `step` counts in place.
    optim = {
        f"state.{name}.{key}": value.full_tensor() if isinstance(value, DTensor) else value.clone()
        for name, param in trainer.model.named_parameters()
        for key, value in trainer.optimizer.state.get(param, {}).items()
    }
    start = {"model": get_model_state_dict(trainer.model, options=_FULL), "optim": optim}
    straight = trainer.fit()
    job = Path(cfg.job.output_dir)
    resumed_dir = job.parent / "resumed"
    if rank == 0:  # a relaunch of stage 2 after its step-2 checkpoint
        shutil.copytree(job / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2")
    dist.barrier()
    again = [a for a in argv if not a.startswith("--job.output_dir")]
    # A profile window before the resume point never acts: said (moetrain.config.notes).
    relaunch = [*again, f"--job.output_dir={resumed_dir}", "--profile.steps=[1,2]"]
    _, trainer = build_trainer(relaunch, world)
    assert trainer.state.step == 2 and any("init_from is not used" in n for n in trainer.notes)
    assert any(n.startswith("profile.steps=[1, 2] lies before step 3") for n in trainer.notes)
    resumed = trainer.fit()
    if rank == 0:
        torch.save({"start": start, "straight": straight, "resumed": resumed}, out)


@pytest.mark.slow
def test_stage2_starts_from_stage1_on_another_layout_and_resumes_exactly(stage1, corpora, tmp_path):
    out = tmp_path / "out.pt"
    argv = _stage2(corpora, stage1, tmp_path / "stage2")
    fresh = _stage2(corpora, stage1, tmp_path / "fresh", optimizer=False)
    run_distributed(_stage2_worker, 4, argv, fresh, str(out))
    got = torch.load(out, weights_only=True)
    dcp_to_torch_save(stage1 / "checkpoints" / "step-2", tmp_path / "stage1.pt")
    saved = torch.load(tmp_path / "stage1.pt", weights_only=True)
    model, optim = got["start"]["model"], got["start"]["optim"]
    assert model.keys() == saved["model"].keys()
    for name, tensor in saved["model"].items():  # stage 1's bits, resharded
        assert torch.equal(model[name], tensor), name
    moments = {k: v for k, v in saved["optim"].items() if k.startswith("state.")}
    assert moments and moments.keys() <= optim.keys()
    for key, tensor in moments.items():
        assert torch.equal(optim[key], tensor), key
    straight, resumed = got["straight"], got["resumed"]
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    assert all(r["tokens/web"] + r["tokens/code"] == r["step"] * 8 * 128 for r in straight)
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == ref["loss"] and ours["grad_norm"] == ref["grad_norm"]


@pytest.mark.slow
def test_what_a_stage_cannot_change_is_refused_by_name(stage1, tmp_path, capsys, monkeypatch):
    ckpt = stage1 / "checkpoints" / "step-2"
    stage = [*STAGE1, f"--checkpoint.init_from={ckpt}", f"--job.output_dir={tmp_path / 'new'}"]
    err = _refused([*stage, "--model.moe_intermediate_size=32"], capsys, monkeypatch)
    assert "experts.gate_up_proj is [8, 128, 128] there but [8, 64, 128]" in err
    assert "model.moe_intermediate_size: checkpoint 64, this run 32" in err
    err = _refused([*stage, "--model.num_hidden_layers=5"], capsys, monkeypatch)
    assert "has no layers.4." in err and "model.num_hidden_layers" in err
    err = _refused([*stage, "--peft.method=lora", "--checkpoint.init_optimizer=true"], capsys,
                   monkeypatch)  # fmt: skip
    assert "holds no optimizer state for" in err and "lora_A" in err
    err = _refused([*STAGE1, "--checkpoint.init_optimizer=true"], capsys, monkeypatch)
    assert "checkpoint.init_from, which is not set" in err
    err = _refused([*stage, f"--checkpoint.resume={ckpt}"], capsys, monkeypatch)
    assert "keep one" in err
    # A resume keeps data.seq_len, even with allow_data_change; the refusal names the way on.
    job = tmp_path / "job"
    shutil.copytree(stage1, job)
    for extra in ([], ["--checkpoint.allow_data_change=true"]):
        longer = [*STAGE1, "--data.seq_len=128", f"--job.output_dir={job}", *extra]
        err = _refused(longer, capsys, monkeypatch)
        assert "data.seq_len=64" in err and "--checkpoint.init_from=" in err


def _lora_stage(stage1: Path, *extra: str) -> list[str]:
    """A LoRA stage from stage 1's job, adapters saved alone, dropout on (its masks must
    come back on a resume), a held-out evaluation at the end."""
    return [
        *STAGE1[:-3],  # stage 1's data and model, not its steps
        "--train.steps=4",
        "--train.warmup_steps=1",
        "--checkpoint.interval=2",
        "--metrics.log_interval=1",
        f"--checkpoint.init_from={stage1}",
        "--peft.method=lora",
        "--peft.dropout=0.1",
        "--eval.fraction=0.05",
        "--eval.samples=16",
        *extra,
    ]


@pytest.mark.slow
def test_a_lora_stage_keeps_its_base_on_resume_evaluation_and_export(
    stage1, tmp_path, capsys, monkeypatch
):
    """The base of a LoRA stage saved without it is stage 1's checkpoint, recorded in its
    checkpoints: a relaunch resumes bit for bit (dropout included), `moetrain.evaluate` gives
    the logged eval loss, and the merged export equals the one of the same stage saved with
    its base (which streams the base from the checkpoint instead of rebuilding it)."""
    from safetensors.torch import load_file

    from moetrain.export.cli import main as export

    straight = run_train(_lora_stage(stage1), tmp_path / "straight")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-2",
                    resumed_dir / "checkpoints" / "step-2")  # fmt: skip
    resumed = run_train(_lora_stage(stage1), resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == ref["loss"] and ours["grad_norm"] == ref["grad_norm"]
    assert resumed[-1]["eval_loss"] == straight[-1]["eval_loss"]
    log = Path(f"{resumed_dir}.log").read_text()
    assert "init_from is not used" in log  # the base comes from the record, not the option
    step4 = resumed_dir / "checkpoints" / "step-4"
    assert torch.load(step4 / "trainer_state.pt", weights_only=True)["base"]["path"] == str(
        stage1 / "checkpoints" / "step-2"
    )

    report = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "moetrain.evaluate", *_lora_stage(stage1), "--checkpoint",
           str(step4), "--json", str(report)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    logged = straight[-1]["eval_loss"]
    assert json.loads(report.read_text())["eval_loss"] == pytest.approx(logged, rel=1e-6)

    full = run_train(_lora_stage(stage1, "--checkpoint.save_frozen=true"), tmp_path / "full")
    assert [r["loss"] for r in full] == [r["loss"] for r in straight]
    monkeypatch.chdir(ROOT)
    outs = {}
    for name, job in (("adapters", resumed_dir), ("full", tmp_path / "full")):
        outs[name] = tmp_path / f"hf_{name}"
        args = ["--checkpoint", str(job / "checkpoints" / "step-4"), "--out", str(outs[name])]
        assert export([*args, "--dtype", "fp32"]) == 0
    merged, reference = (load_file(outs[n] / "model.safetensors") for n in ("adapters", "full"))
    assert merged.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(merged[key], tensor), key

    # Another alpha scales the adapters otherwise: a resume with it is refused by name.
    err = _refused([*_lora_stage(stage1, "--peft.alpha=32"), f"--job.output_dir={resumed_dir}"],
                   capsys, monkeypatch)  # fmt: skip
    assert "peft.alpha: checkpoint 16.0, this run 32.0" in err
