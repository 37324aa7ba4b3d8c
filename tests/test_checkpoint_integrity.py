"""Checkpoints that are verified before they are trusted: checksums recorded at commit and
checked on resume (a flipped byte is refused, naming the file and the older checkpoint to
use), trainer state loaded without running pickled code, and the data identity."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest

from moetrain import train
from moetrain.checkpoint.markers import COMPLETE, TRAINER_STATE
from tests.distributed import ROOT, run_train

RUN = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.source=jsonl",
    "--data.seq_len=64",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=2",
    "--train.steps=2",
    "--checkpoint.interval=1",
    "--metrics.log_interval=1",
]


def _corpus(path: Path, flip: bool) -> Path:
    """60 documents; `flip` reverses each one: the same size, other content."""
    path.mkdir(parents=True, exist_ok=True)
    docs = [f"document number {i} says " + "abc " * (i % 9 + 3) for i in range(60)]
    lines = [json.dumps({"text": d[::-1] if flip else d}) for d in docs]
    (path / "c.jsonl").write_text("\n".join(lines) + "\n")
    return path / "c.jsonl"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    corpus = _corpus(root / "a", flip=False)
    out = root / "run"
    run_train(RUN + [f"--data.path={corpus}"], out)
    return root, corpus, out


@pytest.fixture
def front_door(monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _copy(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished[2], out)
    return out


def _resume(argv: list[str], out: Path, capsys) -> tuple[int, str]:
    code = train.main(argv + ["--train.steps=3", f"--job.output_dir={out}"])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_commit_marker_records_every_file(finished):
    step = finished[2] / "checkpoints" / "step-2"
    files = json.loads((step / COMPLETE).read_text())["files"]
    on_disk = {p.name for p in step.iterdir() if p.name != COMPLETE}
    assert set(files) == on_disk and any(f.endswith(".distcp") for f in files)
    for name, digest in files.items():
        assert hashlib.sha256((step / name).read_bytes()).hexdigest() == digest


@pytest.mark.slow
def test_flipped_bytes_are_refused_naming_the_file_and_the_older_checkpoint(
    finished, tmp_path, capsys, front_door
):
    out = _copy(finished, tmp_path)
    step = out / "checkpoints" / "step-2"
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    shard.write_bytes(data)
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    code, err = _resume(RUN + [f"--data.path={finished[1]}"], out, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert shard.name in err and "corrupted" in err
    assert "step-1" in err and "--checkpoint.resume=" in err  # the way out, not a fallback
    after = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert after == before  # nothing on disk was touched


class _RunsCode:
    """Unpickling this would create a file: the test's witness that code ran."""

    def __init__(self, witness: str) -> None:
        self.witness = witness

    def __reduce__(self):
        return (Path.touch, (Path(self.witness),))


@pytest.mark.slow
def test_trainer_state_that_would_run_code_is_refused(finished, tmp_path, capsys, front_door):
    out = _copy(finished, tmp_path)
    step = out / "checkpoints" / "step-2"
    witness = tmp_path / "code-ran"
    with open(step / TRAINER_STATE, "wb") as f:
        pickle.dump({"step": 2, "evil": _RunsCode(str(witness))}, f)
    marker = json.loads((step / COMPLETE).read_text())  # an attacker fixes the checksum too
    marker["files"][TRAINER_STATE] = hashlib.sha256((step / TRAINER_STATE).read_bytes()).hexdigest()
    (step / COMPLETE).write_text(json.dumps(marker))
    code, err = _resume(RUN + [f"--data.path={finished[1]}"], out, capsys)
    assert code == 2 and TRAINER_STATE in err and "plain data" in err, err
    assert not witness.exists()


@pytest.mark.slow
def test_resume_on_other_data_of_the_same_size_needs_the_flag(
    finished, tmp_path, capsys, front_door
):
    other = _corpus(tmp_path / "b", flip=True)
    assert other.stat().st_size == finished[1].stat().st_size
    out = _copy(finished, tmp_path)
    code, err = _resume(RUN + [f"--data.path={other}"], out, capsys)
    assert code == 2 and "other data" in err and "checkpoint.allow_data_change" in err, err
    code, _ = _resume(
        RUN + [f"--data.path={other}", "--checkpoint.allow_data_change=true"], out, capsys
    )
    assert code == 0


@pytest.mark.slow
def test_resume_into_another_model_is_refused_with_the_keys(finished, tmp_path, capsys, front_door):
    out = _copy(finished, tmp_path)
    argv = RUN + [f"--data.path={finished[1]}", "--model.hidden_size=64"]
    code, err = _resume(argv, out, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert "model.hidden_size: checkpoint 128, this run 64" in err


@pytest.mark.slow
def test_rerunning_a_finished_run_says_there_is_nothing_to_do(
    finished, tmp_path, capsys, front_door
):
    out = _copy(finished, tmp_path)
    code = train.main(RUN + [f"--data.path={finished[1]}", f"--job.output_dir={out}"])
    assert code == 0 and "nothing to do" in capsys.readouterr().out


def _truncate_marker(step: Path) -> str:
    marker = step / COMPLETE
    marker.write_bytes(marker.read_bytes()[: marker.stat().st_size // 2])
    return "COMPLETE is truncated or garbled"


def _garble_marker(step: Path) -> str:
    (step / COMPLETE).write_text("\x00\x01 not a marker")
    return "COMPLETE is truncated or garbled"


def _delete_metadata(step: Path) -> str:
    (step / ".metadata").unlink()
    return ".metadata is missing"


def _delete_distcp(step: Path) -> str:
    shard = sorted(step.glob("*.distcp"))[0]
    shard.unlink()
    return f"{shard.name} is missing"


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage", [_truncate_marker, _garble_marker, _delete_metadata, _delete_distcp]
)
@pytest.mark.parametrize("resume", ["auto", "path"])
def test_damaged_files_are_refused_by_name_with_the_checkpoint_to_use(
    finished, tmp_path, capsys, front_door, damage, resume
):
    out = _copy(finished, tmp_path)
    step = out / "checkpoints" / "step-2"
    what = damage(step)
    argv = RUN + [f"--data.path={finished[1]}"]
    if resume == "path":
        argv.append(f"--checkpoint.resume={step}")
    code, err = _resume(argv, out, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.count("\n") == 1 and what in err and "step-2" in err, err
    older = out / "checkpoints" / "step-1"
    assert f"the newest intact checkpoint is {older}: resume from it with" in err, err
    assert f"--checkpoint.resume={older}" in err
    # The way out works: the older checkpoint resumes.
    code, _ = _resume(
        RUN + [f"--data.path={finished[1]}", f"--checkpoint.resume={older}"], out, capsys
    )
    assert code == 0
