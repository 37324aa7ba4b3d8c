"""The held-out loss ([eval], moetrain/loop/evaluation.py): the same on every layout, free of
side effects on training, reproduced from a checkpoint by `python -m moetrain.evaluate`; and
`eval.fraction`'s hold-out of whole documents (moetrain/data/holdout.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moetrain import train
from moetrain.checkpoint.markers import COMPLETE, TRAINER_STATE, find_checkpoint
from moetrain.config import DataSection, EvalSection, load_config
from moetrain.data.holdout import held_out
from moetrain.data.run_data import build_data
from moetrain.data.tokenizers import ByteTokenizer
from moetrain.errors import CheckpointError
from moetrain.evaluate.cli import main as evaluate
from moetrain.parallelisms.dims import ParallelDims
from moetrain.prepare.cli import main as prepare
from tests.distributed import ROOT, run_distributed, run_train
from tests.parity import TINY, _full
from tests.test_tokens_source import write_jsonl

# 5 samples: no data-parallel size here divides them (ranks get padding that counts nothing).
# 0.4: TINY's 60,000 tokens are 9 documents of the stdlib; a tenth holds out none of them.
EVAL = ["--eval.fraction=0.4", "--eval.samples=5", "--eval.micro_batch_size=2"]


def _eval_worker(rank: int, world: int, argv: list[str], out_path: str) -> None:
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer

    cfg = load_config(argv)
    p = cfg.parallel
    dims = ParallelDims.of(p, world)
    corpora = preflight(cfg, dims)
    trainer = Trainer(cfg, dims, corpora)
    losses = [trainer.evaluate()]
    trainer.steps.train_step(trainer.next_micro_batches())
    losses.append(trainer.evaluate())
    if rank == 0:
        torch.save(losses, out_path)


EVAL_LAYOUTS = {
    "1rank": (1, []),
    "fsdp2": (2, []),
    "hsdp2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),
    "ep2": (2, ["--parallel.ep=2"]),
    "cp2": (2, ["--parallel.cp=2"]),
    "cp2_ep2": (2, ["--parallel.cp=2", "--parallel.ep=2"]),
    # forward only through pipeline stages (moetrain/parallelisms/pipeline_forward.py)
    "pp2_cp2_ep2": (4, ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def eval_losses(tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for name, (world, layout) in EVAL_LAYOUTS.items():
        path = tmp_path_factory.mktemp(name) / "out.pt"
        run_distributed(_eval_worker, world, [*TINY, *EVAL, *layout], str(path))
        out[name] = torch.load(path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EVAL_LAYOUTS if n != "1rank"])
def test_the_eval_loss_is_the_same_on_every_layout(eval_losses, name):
    reference = eval_losses["1rank"]
    assert reference[0]["eval_tokens"] == 5 * 32  # every held-out token, counted once
    assert reference[1]["eval_loss"] < reference[0]["eval_loss"]  # a step of training helps
    for ours, ref in zip(eval_losses[name], reference, strict=True):
        assert ours["eval_tokens"] == ref["eval_tokens"]
        assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
        assert ours["eval_ppl"] == pytest.approx(math.exp(ref["eval_loss"]), rel=1e-6)


def _interleaved_worker(rank: int, world: int, argv: list[str], out_path: str) -> None:
    """Two trainers on the same ranks, one evaluating after every step: the training must
    not see it (losses, grad norms and every parameter bit for bit)."""
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer

    cfg = load_config(argv)
    p = cfg.parallel
    dims = ParallelDims.of(p, world)
    corpora = preflight(cfg, dims)
    runs = []
    for with_eval in (True, False):
        trainer = Trainer(cfg, dims, corpora)
        records = []
        for _ in range(3):
            record = trainer.steps.train_step(trainer.next_micro_batches())
            if with_eval:
                trainer.evaluate()
            records.append((record["loss"], record["grad_norm"], record.get("a2a_bytes")))
        params = {n: _full(q) for n, q in trainer.model.named_parameters()}
        position = trainer.batches.order.sampler.state_at(trainer.state.consumed_samples)
        runs.append((records, params, position))
    if rank == 0:
        torch.save(runs, out_path)
    dist.barrier()


@pytest.mark.slow
def test_evaluating_every_step_changes_nothing_of_the_training(tmp_path):
    argv = [*TINY, *EVAL, "--parallel.cp=2", "--parallel.ep=2"]
    run_distributed(_interleaved_worker, 2, argv, str(tmp_path / "out.pt"))
    (with_eval, params_a, data_a), (without, params_b, data_b) = torch.load(tmp_path / "out.pt")
    assert with_eval == without  # losses, grad norms, the step's all-to-all bytes
    assert data_a == data_b
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


@pytest.mark.slow
def test_trainer_evaluate_gives_the_loss_the_run_logged(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    argv = [*TINY, *EVAL, "--train.steps=2", "--eval.interval=2", "--checkpoint.interval=2"]
    records = run_train([*argv, "--metrics.jsonl=true", "--metrics.log_interval=1"], out)
    logged = records[-1]["eval_loss"]
    checkpoint = out / "checkpoints" / "step-2"
    # NOTE: one thread, as the run had (OMP_NUM_THREADS=1): the same kernels' blocking, so
    # the same bits; other thread counts round the fp32 GEMMs otherwise (~1e-9 of the loss).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        json_out = str(tmp_path / "e.json")
        assert evaluate([*argv, "--checkpoint", str(checkpoint), "--json", json_out]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "eval_loss" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["eval_loss"] == logged
    # The job's output directory means its newest complete checkpoint, said in one line.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert evaluate([*argv, "--checkpoint", str(out), "--json", json_out]) == 0
    finally:
        torch.set_num_threads(threads)
    assert f"--checkpoint={out}: using {checkpoint} (step 2)" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["eval_loss"] == logged
    # On another layout, through torchrun.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "-m",
            "moetrain.evaluate",
            *argv,
            "--parallel.ep=2",
            "--checkpoint",
            str(checkpoint),
            "--json",
            str(tmp_path / "ep.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "ep.json").read_text())["eval_loss"] == pytest.approx(
        logged, rel=1e-6
    )
    # Without held-out data there is nothing to evaluate: a clear refusal.
    assert evaluate([*TINY, "--checkpoint", str(checkpoint)]) == 2
    assert "no held-out data" in capsys.readouterr().err
    # A checkpoint whose bytes changed is refused with evaluation's advice, not a resume's.
    damaged = tmp_path / "damaged" / "step-2"
    shutil.copytree(checkpoint, damaged)
    shard = next(damaged.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert evaluate([*argv, "--checkpoint", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert "does not match the checksum" in err and "no intact checkpoint beside it" in err
    assert "--checkpoint.resume" not in err


# --- what `python -m moetrain.evaluate` is given ----------------------------------------------


def _fake_checkpoint(root: Path, step: int, committed_at: float) -> Path:
    """A step directory with what find_checkpoint looks at: its marker and the files every
    checkpoint has (no weights: nothing here loads them)."""
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / COMPLETE).write_text(json.dumps({"committed_at": committed_at, "files": {}}))
    (path / TRAINER_STATE).write_bytes(b"")
    (path / ".metadata").write_bytes(b"")
    return path


def test_find_checkpoint_takes_a_step_a_checkpoints_or_a_job_directory(tmp_path):
    root = tmp_path / "job" / "checkpoints"
    old, new = _fake_checkpoint(root, 4, 1.0), _fake_checkpoint(root, 2, 2.0)  # a rollback
    assert find_checkpoint(str(old)) == (str(old), None)
    for given in (tmp_path / "job", root):
        path, note = find_checkpoint(str(given), "--checkpoint")
        assert path == str(new)  # the newest commit, not the highest step
        assert note == (
            f"--checkpoint={given}: using {new} (step 2), the newest of its complete checkpoints"
        )
    (new / TRAINER_STATE).unlink()
    os.utime(old, (1.0, 1.0))  # written before the damaged one, whatever the clock's grain
    # A newer damaged checkpoint is refused, as resume=auto refuses it, naming the older
    # intact one to give instead (checkpoint.init_from used to start from it with a note).
    for key in (None, "checkpoint.init_from"):
        with pytest.raises(CheckpointError) as err:
            find_checkpoint(str(tmp_path / "job"), key)
        message = str(err.value)
        assert f"its newest checkpoint, {new}, cannot be used" in message
        assert f"{key + '=' if key else ''}{old}" in message and "trainer_state.pt" in message
    with pytest.raises(CheckpointError, match=f"beside it is {old}: use that one"):
        find_checkpoint(str(new))
    (old / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        find_checkpoint(str(tmp_path / "job"), "checkpoint.init_from")


def test_evaluate_refuses_its_input_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    argv = [*TINY, *EVAL]
    cases = [
        (["--checkpoint", str(job), "--json", str(tmp_path / "no" / "e.json")], "mkdir -p"),
        (["--checkpoint", str(job), "--json", str(tmp_path)], "is a directory"),
        (["--checkpoint", str(job)], "has no step-<N> directory"),
        (["--checkpoint", str(tmp_path / "notes")], "is not a checkpoint"),
    ]
    for extra, expected in cases:
        assert evaluate([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err
        flag = "--json" if "--json" in extra else "--checkpoint"
        assert err.startswith(f"error: {flag}") and expected in err, err
        assert "checkpoint.resume" not in err  # evaluation's advice, not training's
    assert "OUTPUT_DIR/checkpoints/step-<N>" in err


@pytest.mark.slow
def test_evaluate_under_torchrun_refuses_once_and_not_for_the_training_batch(tmp_path):
    """2 ranks: a global batch they cannot split (training's arithmetic, which evaluation
    does not use) and held-out data that is not there: one message, about the data."""
    _fake_checkpoint(tmp_path / "job" / "checkpoints", 1, 1.0)
    argv = [*TINY, "--train.global_batch_size=2", f"--eval.path={tmp_path / 'none'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "-m", "moetrain.evaluate", *argv, "--checkpoint", str(tmp_path / "job")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    assert output.count("error: ") == 1 and "eval.path=" in output, output[-3000:]
    assert output.count("using ") == 1  # the checkpoint it chose: rank 0's line alone
    assert "global_batch_size" not in output


# --- the hold-out ---------------------------------------------------------------------------


def test_the_hold_out_is_a_function_of_the_document_index_alone():
    index = np.arange(200_000)
    mask = held_out(index, 0.1)
    assert abs(mask.mean() - 0.1) < 0.005
    assert np.array_equal(mask, held_out(index.copy(), 0.1))
    assert not (held_out(index, 0.05) & ~mask).any()  # a smaller fraction holds out a subset


def test_prepared_and_in_memory_corpora_hold_out_the_same_documents(tmp_path, capsys):
    docs = [f"document {i}: " + "lorem ipsum dolor " * (i % 11 + 1) for i in range(300)]
    corpus = write_jsonl(tmp_path / "c" / "a.jsonl", docs)
    out = tmp_path / "prepared"
    assert (
        prepare(
            ["--source", "jsonl", "--path", str(corpus), "--out", str(out), "--shard-mb", "0.004"]
        )
        == 0
    )
    eval_cfg = EvalSection(fraction=0.2, samples=4)
    for max_tokens in (None, 9000):
        memory = build_data(
            DataSection(source="jsonl", path=str(corpus), seq_len=16, max_tokens=max_tokens),
            eval_cfg,
            ByteTokenizer(),
        )
        tokens = build_data(
            DataSection(source="tokens", path=str(out), seq_len=16, max_tokens=max_tokens),
            eval_cfg,
            ByteTokenizer(),
        )
        for a, b in (
            (memory.train, tokens.train),
            (memory.held_out[0].dataset, tokens.held_out[0].dataset),
        ):
            assert len(a) == len(b) > 4
            for i in range(len(a)):
                assert torch.equal(a[i].input_ids, b[i].input_ids), (max_tokens, i)
        held = held_out(np.arange(len(docs)), 0.2)
        assert memory.train.summary.documents == tokens.train.summary.documents
        if max_tokens is None:
            assert memory.train.summary.documents == len(docs) - held.sum()
            first_held = docs[int(np.flatnonzero(held)[0])]
            text = bytes(
                memory.held_out[0].dataset.tokens[: len(first_held.encode())].tolist()
            ).decode()
            assert text == first_held  # whole documents, in order


def test_bad_held_out_data_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main([*TINY, "--eval.fraction=0.1", f"--eval.path={tmp_path}"]) == 2
    assert "eval.path and eval.fraction are all held-out data" in capsys.readouterr().err
    assert train.main([*TINY, f"--eval.path={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err
    assert f"eval.path='{tmp_path / 'none'}' does not exist" in err and "moetrain.prepare" in err
    argv = [*TINY, "--eval.fraction=0.5", "--eval.samples=100000", "--train.steps=1"]
    assert train.main([*argv, f"--job.output_dir={tmp_path / 'run'}"]) == 2
    assert "fewer than the 100000 eval.samples" in capsys.readouterr().err


def test_an_eval_interval_without_held_out_data_is_refused(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main([*TINY, "--eval.interval=5"]) == 2
    err = capsys.readouterr().err
    assert "eval.interval=5 evaluates on held-out data, but there is no held-out data" in err
    assert "eval.path, [[eval.mix]] or eval.fraction" in err
    load_config([*TINY, "--eval.interval=5", "--eval.fraction=0.1"])  # with data: accepted
    assert load_config(TINY).eval.interval == 0  # the default is never refused
