"""Document masks through train.py: 1, 2 (cp 2, zigzag and balanced) and 4 (cp 2 x ep 2)
ranks agree, and the mask changes the loss; a DeepSeek-V3 (MLA, MTP) layout-parity run in
pipeline stages with the mask. The pieces: tests/test_document_mask.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed, run_train
from tests.parity import TINY_DSV3, assert_same_training, layout_worker, reference_run


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A JSON-lines corpus of short documents (a few to ~70 bytes): many EOS per sample."""
    words = "def class return import self value data index token model layer for in if".split()
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(3000):
            n = int(torch.randint(1, 13, (1,), generator=g))
            picks = torch.randint(0, len(words), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(words[i] for i in picks)}) + "\n")
    return str(path)


@pytest.mark.slow
def test_train_py_layouts_agree_with_document_masks(short_docs, tmp_path):
    common = [
        "--config=configs/debug_qwen3_moe.toml",
        "--data.source=jsonl",
        f"--data.path={short_docs}",
        "--data.seq_len=64",
        "--data.reset_positions=true",
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--metrics.log_interval=1",
    ]
    masked = [*common, "--data.document_mask=true"]
    one = run_train(masked, tmp_path / "one")
    cp2 = run_train([*masked, "--parallel.cp=2"], tmp_path / "cp2", nproc=2)
    cp2_ep2 = run_train(
        [*masked, "--parallel.cp=2", "--parallel.ep=2"], tmp_path / "cp2_ep2", nproc=4
    )
    # each micro-batch laid out by its documents' work (tests/test_balanced_ring.py)
    balanced = ["--parallel.cp=2", "--parallel.cp_layout=balanced"]
    cp2_balanced = run_train([*masked, *balanced], tmp_path / "cp2_balanced", nproc=2)
    unmasked = run_train(common, tmp_path / "unmasked")
    losses = [r["loss"] for r in one]
    assert len(losses) == 3
    for run in (cp2, cp2_ep2, cp2_balanced):
        assert [r["loss"] for r in run] == pytest.approx(losses, rel=1e-5)
    assert [r["tokens"] for r in unmasked] == [r["tokens"] for r in one]  # same counts
    differ = [abs(a - b) / b for a, b in zip(losses, [r["loss"] for r in unmasked], strict=True)]
    assert max(differ) > 1e-3, f"the mask changed nothing: {differ}"


@pytest.mark.slow
def test_deepseek_v3_mla_mtp_pp2_cp2_ep2_with_document_masks_matches_one_process(
    short_docs, tmp_path
):
    """MLA (v_head_dim != qk_head_dim), MTP, EP and FSDP under cp 2 with the mask, in two
    pipeline stages with activation checkpointing: losses, gradients and updated parameters
    against a plain one-process model given the ids."""
    argv = [
        *TINY_DSV3,
        "--data.source=jsonl",
        f"--data.path={short_docs}",
        "--data.document_mask=true",
        "--data.reset_positions=true",
        "--parallel.cp=2",
        "--parallel.ep=2",
        "--parallel.pp=2",
        "--train.activation_checkpoint=full",
    ]
    run_distributed(layout_worker, 4, argv, str(tmp_path / "out.pt"), None)
    assert_same_training(torch.load(tmp_path / "out.pt")["records"], reference_run(argv, 1))
