"""Faults around checkpoints and metrics become clear messages, and nothing is lost: a save
that cannot be written is refused or removed (the older checkpoint stays the one to resume
from), a dead peer's checksums are waited for within bounds, a half-written metrics line is
dropped at resume."""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.checkpoint.checksums import gather_sums
from moetrain.errors import CheckpointError
from moetrain.metrics.logger import MetricsLogger
from tests.distributed import ROOT, launch_train, read_metrics, run_train
from tests.parity import TINY

RUN = [*TINY, "--checkpoint.interval=2", "--metrics.jsonl=true", "--metrics.log_interval=1"]


def _limited_launch(argv: list[str], out_dir: Path, nproc: int, max_file_bytes: int):
    """train.py whose processes cannot write a file past `max_file_bytes` (RLIMIT_FSIZE:
    writes beyond it fail with EFBIG; Python ignores the SIGXFSZ that comes with them)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run(
        [*launcher, "train.py", *argv, f"--job.output_dir={out_dir}"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )


@pytest.mark.slow
def test_a_write_error_during_a_save_removes_it_and_keeps_the_older_one(tmp_path):
    out = tmp_path / "run"
    run_train([*RUN, "--train.steps=2"], out, nproc=2)  # step-2, whole
    proc = _limited_launch([*RUN, "--train.steps=4"], out, nproc=2, max_file_bytes=64 << 10)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "exitcode  : 2" in log, log[-3000:]
    message = next(line for line in log.splitlines() if line.startswith("error: could not write"))
    assert "step-4" in message and "File too large (EFBIG)" in message
    assert "free in" in message and "the save needs about" in message
    assert "The partial save was removed" in message and "step-2 is intact" in message
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-2"], checkpoints
    # The older checkpoint is whole: a relaunch resumes from it and finishes.
    records = run_train([*RUN, "--train.steps=4"], out, nproc=2)
    assert "resumed from" in (tmp_path / "run.log").read_text()
    assert [r["step"] for r in records] == [1, 2, 3, 4]


def _can_mount_tmpfs() -> list[str] | None:
    """The prefix that runs a command where it may mount a tmpfs: a user namespace where
    the kernel allows one, else plain root; None if neither."""
    probe = 'mount -t tmpfs -o size=64k tmpfs "$1" && umount "$1"'
    for prefix in (["unshare", "-rm"], []):
        if not prefix and os.geteuid() != 0:
            continue
        target = Path(f"/tmp/moetrain-mount-probe-{os.getpid()}")
        target.mkdir(exist_ok=True)
        try:
            ok = subprocess.run([*prefix, "sh", "-c", probe, "sh", str(target)]).returncode == 0
        except FileNotFoundError:
            ok = False
        finally:
            target.rmdir()
        if ok:
            return prefix
    return None


@pytest.mark.slow
def test_a_disk_without_room_refuses_the_save_before_writing(tmp_path):
    prefix = _can_mount_tmpfs()
    if prefix is None:
        pytest.skip("needs a small disk: a tmpfs mount (root or user namespaces) is unavailable")
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    train = shlex.join([sys.executable, "train.py", *RUN, f"--job.output_dir={disk}/run"])
    # One TINY checkpoint is ~3.2 MB: the first fits in 5 MB, the second cannot.
    script = (
        f"mount -t tmpfs -o size=5m tmpfs {disk} && "
        f"{train} --train.steps=2 > {tmp_path}/first.log 2>&1; "
        f"{train} --train.steps=4 > {tmp_path}/second.log 2>&1; echo $? > {tmp_path}/code; "
        f"cp -a {disk}/run {copy}"
    )
    subprocess.run([*prefix, "sh", "-c", script], cwd=ROOT, check=True, timeout=300)
    assert (tmp_path / "code").read_text().strip() == "2"
    log = (tmp_path / "second.log").read_text()
    error = next(line for line in log.splitlines() if line.startswith("error:"))
    assert "not enough disk space for checkpoint" in error and "step-4" in error
    assert "nothing was written" in error and "step-2 is intact" in error
    assert "MiB free in" in error and "the save needs about 3." in error
    assert "Traceback" not in log
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-2"]
    assert [r["step"] for r in read_metrics(copy)] == [1, 2, 3, 4]


def test_the_commit_waits_for_a_dead_peer_within_bounds(tmp_path, capsys):
    (tmp_path / ".sums-0.json").write_text(json.dumps({"__0_0.distcp": "ab"}))
    with pytest.raises(CheckpointError, match=r"0 s passed while waiting for rank 1 to write"):
        gather_sums(str(tmp_path), 3 - 1, lambda: False, timeout=0.2, say_after=0.0)
    assert "waiting for rank 1" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"SIGTERM came while waiting for ranks 1, 2"):
        gather_sums(str(tmp_path), 3, lambda: True, grace=0.1)
    (tmp_path / ".sums-1.json").write_text(json.dumps({"__1_0.distcp": "cd"}))
    merged = gather_sums(str(tmp_path), 2, lambda: False)
    assert merged == {"__0_0.distcp": "ab", "__1_0.distcp": "cd"}
    assert not list(tmp_path.glob(".sums-*"))


def _metrics(lines: list[dict], half: str = "") -> str:
    return "".join(json.dumps(r) + "\n" for r in lines) + half


def test_a_half_written_metrics_line_is_dropped_at_resume(tmp_path):
    records = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text(_metrics(records, half='{"step": 4, "lo'))
    logger = MetricsLogger(str(tmp_path), 10, True, True, False, resume_step=2)
    assert "dropped line 4 that did not parse" in logger.notes[0]
    assert (tmp_path / "metrics.jsonl").read_text() == _metrics(records[:2])
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_failed_rewrite_of_the_metrics_leaves_them_whole(tmp_path):
    text = _metrics([{"step": s, "loss": 1.0, "pad": "x" * 200} for s in range(1, 40)])
    (tmp_path / "metrics.jsonl").write_text(text)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))\n"  # the rewrite cannot fit
        "from moetrain.metrics.logger import MetricsLogger\n"
        f"MetricsLogger({str(tmp_path)!r}, 50, True, True, False, resume_step=30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "File too large" in proc.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == text  # the old history, whole


@pytest.mark.slow
def test_resume_after_a_kill_mid_line_goes_on(tmp_path):
    out = tmp_path / "run"
    run_train([*RUN, "--train.steps=2"], out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.2, "grad_n')  # what a kill mid-write leaves
    proc = launch_train([*RUN, "--train.steps=3"], out)
    proc.wait(timeout=300)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "dropped line 3 that did not parse" in log
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    shutil.rmtree(out)
