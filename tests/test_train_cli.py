"""train.py through the front door: refusals before any set-up, and 1 vs 2 ranks."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moetrain import train
from tests.distributed import run_train

ROOT = Path(__file__).resolve().parent.parent
DEBUG = "--config=configs/debug_qwen3_moe.toml"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--config=configs/nope.toml"], "configs/nope.toml"),
        ([DEBUG, "--train.stpes=3"], "did you mean --train.steps?"),
        ([DEBUG, "--train.steps=three"], "train.steps"),
        ([DEBUG, "--data.source=text", "--data.path=no/such/dir/*.txt"], "data.path"),
        ([DEBUG, "--model.vocab_size=200"], "vocab_size"),
        ([DEBUG, "--train.global_batch_size=6", "--train.micro_batch_size=4"], "global_batch_size"),
        ([DEBUG, "--model.init_from_hf=no/such/dir"], "config.json"),
        (["--train.steps=3"], "no --config given"),
        ([DEBUG, "--data.seq_len=2048"], "longer than the 1024 positions"),
    ],
    ids=[
        "missing-config",
        "unknown-key",
        "wrong-type",
        "data-path",
        "vocab",
        "batch",
        "hf-dir",
        "no-config",
        "seq-len",
    ],
)
def test_bad_input_is_refused_with_exit_code_2(argv, expected, capsys):
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and expected in err, err
    assert "Traceback" not in err


def test_world_size_that_does_not_fit_the_degrees(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main([DEBUG, "--parallel.dp_replicate=2"]) == 2
    err = capsys.readouterr().err
    assert "world size is 3" in err or "world size 3" in err, err


def test_refusal_from_the_shell_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "train.py", DEBUG, "--train.stpes=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "train.steps" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(
    "argv,env",
    [
        ([DEBUG, "--train.stpes=3"], {}),  # the config
        ([DEBUG, "--parallel.cp=3"], {}),  # a cross-field check
        ([DEBUG, "--parallel.dp_replicate=2"], {"WORLD_SIZE": "3"}),  # the layout
        ([DEBUG, "--profile.steps=[3, 1]"], {}),
    ],
    ids=["config", "cross-field", "layout", "profile"],
)
def test_refusals_answer_before_torch_is_imported(argv, env):
    """A refused launch must not pay for torch's import (seconds per rank under torchrun)."""
    code = f"import sys, train\ncode = train.main({argv!r})\nprint(code, 'torch' in sys.modules)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.startswith("error:")


def test_help_lists_every_key():
    proc = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0
    for key in ("--train.global_batch_size", "--parallel.dp_shard", "--model.num_experts"):
        assert key in proc.stdout


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def _model_figures(records: list[dict]) -> list[dict]:
    """The records without what measures the run (speed, memory) rather than the model."""
    measured = {"tokens_per_s", "step_time_s", "peak_mem_gib"}
    return [{k: v for k, v in r.items() if k not in measured} for r in records]


@pytest.mark.slow
def test_every_layout_writes_the_same_losses_as_one_rank(tmp_path):
    """1 rank; 2 ranks FSDP; 4 ranks CP 2 x EP 2, through train.py and torchrun. (Every
    layout's numerics, one at a time, in-process: tests/test_layout_parity.py; EP and CP
    alone, in-process: tests/test_model_layouts.py and tests/test_document_mask_train.py.)

    The other tests fork their ranks from a preloaded server (tests/distributed.py): the
    same 2-rank run started that way must write exactly what torchrun's did."""
    common = [
        DEBUG,
        "--train.steps=4",
        "--train.warmup_steps=2",
        "--data.max_tokens=200000",
        "--metrics.log_interval=1",
        "--metrics.expert_load_interval=2",
    ]
    one = run_train(common, tmp_path / "one", torchrun=True)
    two = run_train(common, tmp_path / "two", nproc=2, torchrun=True)
    cp_ep_args = common + ["--parallel.cp=2", "--parallel.ep=2"]
    cp_ep = run_train(cp_ep_args, tmp_path / "cp_ep", nproc=4, torchrun=True)
    forked = run_train(common, tmp_path / "forked", nproc=2)
    assert _model_figures(forked) == _model_figures(two)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= two[0].keys()
    losses = [r["loss"] for r in one]
    for run in (two, cp_ep):
        assert [r["loss"] for r in run] == pytest.approx(losses, rel=1e-5)
    assert all(r["a2a_bytes"] > 0 for r in cp_ep) and "a2a_bytes" not in one[0]
    # Expert load: every MoE layer's counts cover the whole global batch (16 x 128 x top-2).
    # Logged at the run's first step (the init's routing) and every 2nd: steps 1, 2 and 4.
    assert [r["step"] for r in one if "expert_load" in r] == [1, 2, 4]
    assert len(one[1]["expert_load"]) == 3
    for run in (one, cp_ep):
        for step in (0, 1):
            assert all(sum(layer) == 16 * 128 * 2 for layer in run[step]["expert_load"])
    assert [r.get("expert_load") for r in one] == [r.get("expert_load") for r in cp_ep]


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_shown_every_time():
    """Whichever rank exits first, the message reaches the user: 10 launches of 4 ranks.

    NOTE: two launches at a time, each on a rendezvous port of its own (--standalone). A
    launch is start-up only (torchrun's agent, then four interpreters importing torch before
    the refusal), and the agent's part runs on one core: two in flight keep both busy.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "train.py", DEBUG, "--parallel.ep=16"]  # fmt: skip

    def launch(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        launches = list(pool.map(launch, range(10)))
    for i, proc in enumerate(launches):
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, i
        assert output.count("error: parallel.ep=16 must divide") >= 1, (
            f"launch {i}:\n{output[-2000:]}"
        )


def test_a_corrupt_safetensors_file_is_refused_by_name(tmp_path, capsys):
    from moetrain.config import load_config
    from moetrain.models import get_model_spec

    cfg = load_config([DEBUG])
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = get_model_spec("qwen3_moe").hf_adapter.hf_config_dict(cfg.model.args)
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length it cannot hold
    assert train.main([DEBUG, f"--model.init_from_hf={hf_dir}"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a readable safetensors file" in err, err
    assert "Traceback" not in err
