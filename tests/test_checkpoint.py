"""Distributed checkpoints through the front door: exact and resharding resume, atomicity
under kill -9, SIGTERM, restarts, retention, async vs sync, HF export."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moetrain import train
from tests.distributed import ROOT, finish, kill_launch, launch_train, read_metrics, run_train

DEBUG = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--metrics.log_interval=1",
]
FOUR_STEPS = DEBUG + ["--train.steps=4", "--train.warmup_steps=2", "--checkpoint.interval=2"]


def _resume_from(step_dir, out_dir):
    """A fresh run directory holding only the given checkpoint (resume=auto finds it)."""
    shutil.copytree(step_dir, out_dir / "checkpoints" / step_dir.name)
    return out_dir


# The reference saves with foreach AdamW; the resharding resumes below run the default,
# fused: a checkpoint resumes across the two (tests/test_optimizer_step.py checks that the
# resumed run keeps its own kernels).
FOREACH = "--train.optimizer_impl=foreach"


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """The uninterrupted reference: 4 ranks, EP 2 x efsdp 2, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ep_run")
    return out, run_train(FOUR_STEPS + ["--parallel.ep=2", FOREACH], out, nproc=4)


@pytest.mark.slow
def test_resume_on_the_same_layout_is_exact(ep_run, tmp_path):
    out, straight = ep_run
    assert sorted(os.listdir(out / "checkpoints")) == ["step-2", "step-4"]
    resumed_dir = _resume_from(out / "checkpoints" / "step-2", tmp_path / "resumed")
    resumed = run_train(FOUR_STEPS + ["--parallel.ep=2", FOREACH], resumed_dir, nproc=4)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == ref["loss"] and ours["grad_norm"] == ref["grad_norm"]
        assert ours["data_fingerprint"] == ref["data_fingerprint"]


@pytest.mark.slow
def test_bf16_optimizer_state_resumes_exactly_under_ep(tmp_path):
    """`train.optimizer_state_dtype=bf16` on DTensor parameters (EP 2 x efsdp 2, the dense
    ones over 4 FSDP ranks): a resume from step 2 logs steps 3 and 4 as the straight run."""
    argv = FOUR_STEPS + ["--parallel.ep=2", "--train.optimizer_state_dtype=bf16"]
    straight = run_train(argv, tmp_path / "straight", nproc=4)
    resumed_dir = _resume_from(tmp_path / "straight" / "checkpoints" / "step-2", tmp_path / "r")
    resumed = run_train(argv, resumed_dir, nproc=4)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == ref["loss"] and ours["grad_norm"] == ref["grad_norm"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,layout", [(4, ["--parallel.ep=4"]), (2, ["--parallel.pp=2"])], ids=["ep4", "pp2"]
)
def test_resume_on_another_layout(ep_run, nproc, layout, tmp_path):
    out, straight = ep_run
    resumed_dir = _resume_from(out / "checkpoints" / "step-2", tmp_path / "resharded")
    resumed = run_train(FOUR_STEPS + layout, resumed_dir, nproc=nproc)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):  # fused after foreach
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        # The same samples, though the number of data-parallel ranks changed.
        assert ours["data_fingerprint"] == ref["data_fingerprint"]


@pytest.mark.slow
def test_resume_from_pipeline_stages_into_one_process(tmp_path):
    """Interleaved stages (2 per rank) with a tied head, whose embedding both the first and
    the last stage hold -> 1 rank: the checkpoint's keys are the model's, once each."""
    tied = FOUR_STEPS + ["--model.tie_word_embeddings=true"]
    pp = ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B"]
    straight = run_train(tied + pp, tmp_path / "straight", nproc=2)
    resumed_dir = _resume_from(tmp_path / "straight" / "checkpoints" / "step-2", tmp_path / "one")
    resumed = run_train(tied, resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_export_reproduces_our_logits_in_transformers(ep_run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    from moetrain.checkpoint.whole_model import load_checkpoint_model

    step_dir = ep_run[0] / "checkpoints" / "step-4"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetrain.export",
            f"--checkpoint={step_dir}",
            f"--out={tmp_path / 'hf'}",
            "--dtype=fp32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ours, _, _ = load_checkpoint_model(str(step_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    )
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens).logits, rtol=1e-4, atol=1e-4)
    assert "experts.0.gate_proj.weight" in (tmp_path / "hf" / "model.safetensors").read_bytes()[
        :100000
    ].decode("latin1")


def _full_state(step_dir, tmp_path):
    path = tmp_path / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, path)
    return torch.load(path, weights_only=False)


def _assert_same(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_async_save_equals_sync_and_keep_last_prunes(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    run_train(FOUR_STEPS + ["--checkpoint.interval=1", "--checkpoint.keep_last=2"], sync_dir)
    run_train(FOUR_STEPS + ["--checkpoint.async_save=true"], async_dir)
    assert sorted(os.listdir(sync_dir / "checkpoints")) == ["step-3", "step-4"]
    assert sorted(os.listdir(async_dir / "checkpoints")) == ["step-2", "step-4"]
    sync_state = _full_state(sync_dir / "checkpoints" / "step-4", tmp_path)
    async_state = _full_state(async_dir / "checkpoints" / "step-4", tmp_path)
    assert len(sync_state["model"]) > 10
    assert any(key.endswith(".exp_avg") for key in sync_state["optim"])  # optimizer state saved
    _assert_same(async_state, sync_state)


def _workers(proc) -> list[int]:
    """The torchrun launcher's worker processes."""
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_launch(proc)
            pytest.fail("the run ended early or timed out; see its .log next to its output dir")
        time.sleep(0.005)


@pytest.mark.slow
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    # A model large enough (~25M parameters, ~300 MB of state with its checksums) that a
    # save takes a while; the watcher polls every 5 ms.
    big = FOUR_STEPS + [
        "--model.hidden_size=512",
        "--model.moe_intermediate_size=512",
        "--model.num_attention_heads=8",
        "--model.head_dim=128",
        "--data.seq_len=16",
        "--train.global_batch_size=2",
        "--train.micro_batch_size=1",
    ]
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    proc = launch_train(big, out, nproc=2)
    _wait_for(lambda: (ckpts / "step-2" / "COMPLETE").exists(), proc)
    _wait_for(lambda: (ckpts / ".tmp-step-4").exists(), proc)
    kill_launch(proc)  # the whole launch, mid-write
    assert not (ckpts / "step-4").exists() and (ckpts / "step-2" / "COMPLETE").exists()
    logged = read_metrics(out)

    resumed = run_train(big, out, nproc=2)  # resume=auto: the newest complete checkpoint
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # history kept up to step 2
    for ours, ref in zip(resumed[2:], logged[2:4], strict=True):
        assert ours["loss"] == ref["loss"]
    assert sorted(os.listdir(ckpts)) == ["step-2", "step-4"]  # the leftover was cleaned


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = DEBUG + ["--train.steps=400"]
    proc = launch_train(args, out, nproc=2)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 3, proc)
    # A second launch into the live run's directory is refused, naming its rank 0 (issue 64).
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main([*args, f"--job.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f"job.output_dir {out} is in use by a live run: pid " in err, err
    holder = int(err.split("live run: pid ")[1].split()[0])
    assert holder in _workers(proc) and "give this run another --job.output_dir" in err
    for pid in _workers(proc):  # what a scheduler does before preemption
        os.kill(pid, signal.SIGTERM)
    output = finish(proc, out, timeout=120)
    assert proc.returncode == 0, output[-2000:]
    last = read_metrics(out)[-1]["step"]
    assert last < 400 and "SIGTERM: saving step" in output
    assert sorted(os.listdir(out / "checkpoints")) == [f"step-{last}"]

    resumed = run_train(DEBUG + [f"--train.steps={last + 2}"], out, nproc=2)
    assert [r["step"] for r in resumed][-3:] == [last, last + 1, last + 2]


@pytest.mark.slow
def test_relaunch_after_a_crash_resumes_by_itself(tmp_path):
    """What a restart does (a scheduler's requeue, torchrun --max-restarts): the same command
    again after every process died; resume=auto picks up the last checkpoint."""
    out = tmp_path / "run"
    args = DEBUG + ["--train.steps=12", "--checkpoint.interval=3"]
    proc = launch_train(args, out, nproc=2)
    _wait_for(lambda: (out / "checkpoints" / "step-3" / "COMPLETE").exists(), proc)
    kill_launch(proc)  # crash: every process gone, no chance to save
    relaunch = launch_train(args, out, nproc=2)
    output = finish(relaunch, out)
    assert relaunch.returncode == 0, output[-2000:]
    assert "resumed from" in output
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 13))


@pytest.mark.parametrize("damage", ["missing", "incomplete"])
def test_bad_resume_path_is_refused(damage, ep_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "step-2"
    if damage == "incomplete":
        shutil.copytree(ep_run[0] / "checkpoints" / "step-2", path)
        (path / "COMPLETE").unlink()
    assert train.main(FOUR_STEPS + [f"--checkpoint.resume={path}"]) == 2
    err = capsys.readouterr().err
    if damage == "missing":
        assert str(path) in err and "no such directory" in err
    else:
        assert f"checkpoint {path} is damaged: {path / 'COMPLETE'} is missing" in err, err


@pytest.mark.slow
def test_resume_from_plain_fsdp_into_expert_parallelism(tmp_path):
    """1 rank, no EP (2 optimizer groups) -> 2 ranks with EP (experts get groups of their own)."""
    straight_dir = tmp_path / "straight"
    straight = run_train(FOUR_STEPS, straight_dir)
    resumed_dir = _resume_from(straight_dir / "checkpoints" / "step-2", tmp_path / "into_ep")
    resumed = run_train(FOUR_STEPS + ["--parallel.ep=2"], resumed_dir, nproc=2)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_newest_means_last_committed(tmp_path):
    """After a rollback (resume from an older step), the abandoned run's later steps are
    older commits: resume=auto and keep_last follow the run that is going on."""
    from moetrain.checkpoint.markers import COMPLETE, complete_checkpoints

    for step, committed in [(200, 10.0), (100, 5.0), (110, 20.0)]:
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / COMPLETE).write_text(
            f'{{"step": {step}, "committed_at": {committed}}}'
        )
    (tmp_path / "step-300").mkdir()  # no COMPLETE: a damaged one is never picked
    (tmp_path / ".tmp-step-120").mkdir()
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [100, 200, 110]
