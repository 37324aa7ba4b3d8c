"""Streaming export: a checkpoint several times larger than the export's memory bound is
written with peak memory bounded by the shard size (measured RSS of the real CLI), and
reloads in transformers with the model's logits. The CLI: the dtype each kind of export
writes, a job directory for its newest checkpoint, refused shard sizes, and an earlier
export kept whole when a later one fails or is killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.build.lora import apply_lora, init_adapters
from moetrain.checkpoint.markers import COMPLETE, TRAINER_STATE
from moetrain.config import config_to_dict, load_config
from moetrain.models import get_model_spec
from moetrain.models.common.weight_init import init_all_
from tests.distributed import ROOT

SHARD_MB = 4


def model_argv(layers: int) -> list[str]:
    """A Qwen3-MoE of ~7 MB of fp32 weights per layer whose largest tensors (embedding,
    head, an expert stack) are 4 MB each: 24 layers make it 40 times the shard size."""
    return [
        "--config=configs/debug_qwen3_moe.toml",
        "--model.vocab_size=4096",
        "--model.hidden_size=256",
        "--model.num_attention_heads=4",
        "--model.num_key_value_heads=2",
        "--model.num_experts=16",
        "--model.moe_intermediate_size=128",
        "--model.head_dim=64",
        f"--model.num_hidden_layers={layers}",
    ]


# Peak resident memory of the export above the process's resident memory just before it,
# sampled from /proc every millisecond (ru_maxrss would report the import's own peak).
MEASURE = """
import json, os, sys, threading, time
import moetrain.export.cli
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
base, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
code = moetrain.export.cli.main(sys.argv[1:])
done.set()
thread.join()
print(json.dumps({"code": code, "growth_mb": (max(peak[0], rss()) - base) / 2**20}))
"""


def _checkpoint(tmp_path, argv: list[str], name: str):
    """A real DCP checkpoint (the trainer's layout) of a randomly initialised model; with
    `--peft.method=lora`, of the model with adapters as if trained (B != 0), saved whole."""
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.args)
    if cfg.peft.method == "lora":
        apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    init_all_(model, seed=1)
    if cfg.peft.method == "lora":
        init_adapters(model, seed=1)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if key.endswith("lora_B"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    ckpt = tmp_path / name / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"step": 1, "config": config_to_dict(cfg)}, ckpt / TRAINER_STATE)
    (ckpt / COMPLETE).write_text(json.dumps({"step": 1, "committed_at": 0.0}))
    weights = [*model.parameters(), *model.buffers()]
    return cfg, model, ckpt, sum(t.numel() * t.element_size() for t in weights) / 2**20


def _export(ckpt, out) -> float:
    """Run the real CLI in a fresh process; returns its peak memory growth in MB."""
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, "--checkpoint", str(ckpt), "--out", str(out),
         "--dtype", "fp32", f"--max-shard-gb={SHARD_MB / 1024}"],
        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    return result["growth_mb"]


@pytest.mark.slow
def test_export_memory_does_not_grow_with_the_model_and_reloads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, _, small_ckpt, small_mb = _checkpoint(tmp_path, model_argv(6), "small")
    cfg, model, ckpt, model_mb = _checkpoint(tmp_path, model_argv(24), "big")
    assert model_mb > 3.5 * small_mb and model_mb > 30 * SHARD_MB
    small_growth = _export(small_ckpt, tmp_path / "hf_small")
    out = tmp_path / "hf"
    growth = _export(ckpt, out)
    print(f"\nexport peak RSS growth: {small_mb:.0f} MB model -> {small_growth:.0f} MB, "
          f"{model_mb:.0f} MB model -> {growth:.0f} MB (shards of {SHARD_MB} MB)")  # fmt: skip
    # Bounded by the shard size, not the model: 4x the weights, the same memory (up to
    # allocator noise), and far below the model.
    assert growth < small_growth + 3 * SHARD_MB and growth < model_mb / 2
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and not any(".partial" in f for f in files)
    assert sum(f.endswith(".safetensors") for f in files) >= model_mb // SHARD_MB

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.args.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        ours, theirs = model.eval()(ids).logits, hf.eval()(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_export_replaces_an_earlier_one_whole_or_not_at_all(tmp_path, capsys):
    """Fast half of the export-into-a-used-directory check (the slow half, through train.py
    with transformers loading each export: test_lora.py's adapter export)."""
    from moetrain.export.cli import main

    _, _, ckpt, _ = _checkpoint(tmp_path, ["--config=configs/debug_qwen3_moe.toml"], "run")
    out = tmp_path / "hf"
    export = ["--checkpoint", str(ckpt), "--out", str(out), "--dtype=fp32"]
    assert main([*export, "--max-shard-gb=0.0001"]) == 0  # sharded
    assert main(export) == 0  # one file: no shard or index of the first is left
    first = _files(out)
    assert sorted(first) == ["config.json", "model.safetensors"]

    # Cut short while reading the checkpoint: the earlier export is left as it was.
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointException):  # DCP's, for a file it cannot read
        main([*export, "--max-shard-gb=0.0001"])
    assert _files(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    # Killed between the swap's two renames: the next export puts the old one back first.
    out.rename(tmp_path / ".hf.replaced")
    with pytest.raises(CheckpointException):
        main(export)
    assert _files(out) == first and not (tmp_path / ".hf.replaced").exists()

    # A directory with files an export does not write is refused, naming one; kept.
    (out / "notes.txt").write_text("{}")
    capsys.readouterr()
    assert main(export) == 2
    err = capsys.readouterr().err
    assert f"export directory {out} holds files an export does not write (notes.txt)" in err
    assert "Export to a new or empty directory (--out)" in err
    assert _files(out) == {**first, "notes.txt": b"{}"}


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory):
    """(config, model, checkpoint) of a job's output directory holding one LoRA checkpoint."""
    root = tmp_path_factory.mktemp("lora")
    argv = ["--config=configs/debug_qwen3_moe.toml", "--peft.method=lora"]
    cfg, model, ckpt, _ = _checkpoint(root, argv, "job/checkpoints")
    return cfg, model, ckpt


def test_adapters_export_in_their_trained_dtype_and_merged_weights_in_bf16(
    lora_job, tmp_path, capsys
):
    """peft's save_pretrained keeps adapters in their training dtype; ours wrote bf16 by
    default, which moved peft's logits 3.2e-3 from the merged export's on tests/test_lora.py's
    trained adapters (that test checks the two agree within 1e-4, on the defaults)."""
    from safetensors.torch import load_file

    from moetrain.export.adapters import PREFIX
    from moetrain.export.cli import main
    from moetrain.hf.peft_format import WEIGHTS, peft_layout

    cfg, model, ckpt = lora_job
    layout = peft_layout(model, get_model_spec(cfg.model.name).hf_adapter, cfg.model.args)
    params = dict(model.named_parameters())
    for extra, dtype, why in (
        ((), torch.float32, "the checkpoint's dtype; --dtype to change"),
        (("--dtype=bf16",), torch.bfloat16, "--dtype"),
    ):
        out = tmp_path / "adapters"
        assert main(["--checkpoint", str(ckpt), "--out", str(out), "--adapters", *extra]) == 0
        name = "fp32" if dtype == torch.float32 else "bf16"
        assert f"wrote {out}: adapters in {name} ({why}) from {ckpt}\n" in capsys.readouterr().out
        written = load_file(out / WEIGHTS)
        assert len(written) == len(layout.entries)
        for key, entry in layout.entries.items():  # the saved values, rounded only if asked
            assert written[PREFIX + key].dtype == dtype
            assert torch.equal(written[PREFIX + key], entry.to_peft(params[entry.native]).to(dtype))

    out = tmp_path / "merged"  # merged weights keep their default
    assert main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert (
        f"wrote {out}: weights in bf16 (the default; --dtype to change)" in capsys.readouterr().out
    )
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_a_job_directory_means_its_newest_checkpoint_and_anything_else_is_refused(
    lora_job, tmp_path, capsys
):
    """As moetrain.generate and moetrain.evaluate read it (find_checkpoint); it was taken for
    a damaged checkpoint ("COMPLETE is missing ... --checkpoint.resume=none")."""
    from moetrain.export.cli import main

    job = tmp_path / "job"
    shutil.copytree(lora_job[2].parent.parent, job)
    newest = job / "checkpoints" / "step-2"
    shutil.copytree(job / "checkpoints" / "step-1", newest)
    (newest / COMPLETE).write_text(json.dumps({"step": 2, "committed_at": 1.0}))
    capsys.readouterr()
    assert main(["--checkpoint", str(job), "--out", str(tmp_path / "from_job")]) == 0
    printed = capsys.readouterr().out
    assert f"--checkpoint={job}: using {newest} (step 2), the newest of its complete" in printed
    assert f"from {newest}\n" in printed
    assert main(["--checkpoint", str(newest), "--out", str(tmp_path / "from_step")]) == 0
    assert _files(tmp_path / "from_job") == _files(tmp_path / "from_step")

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("")
    capsys.readouterr()
    assert main(["--checkpoint", str(notes), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint={notes} is not a checkpoint" in err
    assert "give a checkpoint's directory (OUTPUT_DIR/checkpoints/step-<N>) or the output" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_shard_size_that_is_not_positive_is_refused_before_anything_is_read(
    value, tmp_path, capsys
):
    """0 and -1 wrote one file per tensor. A missing checkpoint: the flag is judged first."""
    from moetrain.export.cli import main

    argv = ["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")]
    assert main([*argv, f"--max-shard-gb={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --max-shard-gb={value}: each safetensors file holds up to")
    assert "must be above 0, at least one byte (e.g. --max-shard-gb=4, the default)" in err
    # Adapters are one file, the one peft loads: the flag would be ignored.
    assert main([*argv, "--adapters", "--max-shard-gb=1"]) == 2
    assert "--max-shard-gb=1 with --adapters" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_export_killed_midway_leaves_the_earlier_one_and_a_rerun_succeeds(lora_job, tmp_path):
    """SIGKILL as the first of a sharded export's 21 files appears (~0.8 s before it
    would finish): no cleanup runs, and the earlier export stays byte for byte."""
    from moetrain.export.cli import main

    ckpt = lora_job[2]
    out = tmp_path / "hf"

    def sharded(out_dir) -> list[str]:
        return ["--checkpoint", str(ckpt), "--out", str(out_dir), "--max-shard-gb=0.0001"]

    assert main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0  # one file
    earlier = _files(out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrain.export", *sharded(out)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    # Where the first file appears (the staging directory; `out` itself would fail the test).
    found, deadline = [], time.monotonic() + 120
    while not found and proc.poll() is None and time.monotonic() < deadline:
        found = list(tmp_path.glob("*/model-1.safetensors.partial"))
        time.sleep(0.001)
    proc.kill()
    code, err = proc.wait(), proc.stderr.read().decode()
    assert code == -signal.SIGKILL, f"the export was not killed midway (exit {code}): {err}"
    left = sorted(p.name for p in found[0].parent.iterdir())  # mid-stream: no index, config
    assert "model-1.safetensors.partial" in left and "config.json" not in left, left
    assert _files(out) == earlier

    assert main(sharded(out)) == 0  # the rerun clears the killed one's files, replaces `out`
    assert main(sharded(tmp_path / "fresh")) == 0
    rerun = _files(out)
    assert rerun == _files(tmp_path / "fresh") and "model.safetensors.index.json" in rerun
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "hf"]
