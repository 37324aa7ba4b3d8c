"""Streaming export: a checkpoint several times larger than the export's memory bound is
written with peak memory bounded by the shard size (measured RSS of the real CLI), and
reloads in transformers with the model's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from models import get_model_spec
from models.common.init import init_all_
from tests.distributed import ROOT
from trainer.checkpoint.markers import COMPLETE, TRAINER_STATE
from trainer.config import config_to_dict, load_config

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
import trainer.hf.export
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
code = trainer.hf.export.main(sys.argv[1:])
done.set()
thread.join()
print(json.dumps({"code": code, "growth_mb": (max(peak[0], rss()) - base) / 2**20}))
"""


def _checkpoint(tmp_path, argv: list[str], name: str):
    """A real DCP checkpoint (the trainer's layout) of a randomly initialised model."""
    cfg = load_config(argv)
    model = get_model_spec(cfg.model.name).build(cfg.model.args)
    init_all_(model, seed=1)
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
    from trainer.hf.export import main

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
