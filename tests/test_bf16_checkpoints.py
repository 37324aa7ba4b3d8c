"""Checkpoints and export of bf16 runs (gloo, CPU): a resume continues bit for bit, and
the export writes the fp32 master weights. The numerics of bf16 itself:
tests/test_bf16.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from tests.distributed import ROOT, run_distributed, run_train
from tests.parity import build_trainer
from tests.test_bf16 import U_BF16, U_FP32, _rel

BF16 = ["--train.mixed_precision=bf16"]
CKPT = ["--config=configs/debug_qwen3_moe.toml", "--data.max_tokens=200000",
        "--metrics.log_interval=1", "--train.steps=4", "--train.warmup_steps=2",
        "--checkpoint.interval=2", *BF16]  # fmt: skip


def loaded_worker(rank: int, world: int, argv: list[str], out: str) -> None:
    """The full fp32 weights a run resumed from a checkpoint starts with."""
    _, trainer = build_trainer(argv, world)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()}  # fmt: skip
    if rank == 0:
        torch.save(full, out)


def hf_logits_worker(rank: int, world: int, runs: dict[str, list[str]], tokens, out: str) -> None:
    """Our logits, in each run's compute dtype, of models started from a Hugging Face
    directory (one after the other on this rank)."""
    logits = {}
    for name, argv in runs.items():
        _, trainer = build_trainer(argv, world)
        with torch.no_grad():
            logits[name] = trainer.model(tokens).logits
    torch.save(logits, out)


def _export(step_dir, out_dir, dtype: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    cmd = [sys.executable, "-m", "moetrain.export", f"--checkpoint={step_dir}",
           f"--out={out_dir}", f"--dtype={dtype}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    tensors = {}
    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.slow
def test_bf16_runs_resume_bitwise_and_export_their_fp32_master(tmp_path):
    straight = run_train(CKPT, tmp_path / "straight", nproc=2)
    step2 = tmp_path / "straight" / "checkpoints" / "step-2"
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step2, resumed_dir / "checkpoints" / "step-2")
    resumed = run_train(CKPT, resumed_dir, nproc=2)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (ref["loss"], ref["grad_norm"])

    # The checkpoint holds fp32 master weights, and another layout starts from their bits.
    dcp_to_torch_save(step2, tmp_path / "step2.pt")
    master = torch.load(tmp_path / "step2.pt", weights_only=True)["model"]
    assert {t.dtype for t in master.values() if t.is_floating_point()} == {torch.float32}
    ep2 = [*CKPT, "--parallel.ep=2", f"--checkpoint.resume={step2}",
           f"--job.output_dir={tmp_path / 'ep2'}"]  # fmt: skip
    run_distributed(loaded_worker, 2, ep2, str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded.keys() <= master.keys()
    assert all(torch.equal(t, master[n]) for n, t in loaded.items())

    # Export: fp32 writes the master's bits, bf16 (the default) their rounding.
    fp32 = _export(step2, tmp_path / "hf32", "fp32")
    bf16 = _export(step2, tmp_path / "hf16", "bf16")
    assert fp32.keys() == bf16.keys()
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert all(torch.equal(bf16[k], t.to(torch.bfloat16)) for k, t in fp32.items())
    same_name = [n for n in master if f"model.{n}" in fp32]
    assert same_name and all(torch.equal(fp32[f"model.{n}"], master[n]) for n in same_name)

    # init_from_hf from the bf16 directory, our logits and transformers' each against one
    # reference: transformers in fp32 on the same bf16 weights, so that only the compute
    # precision differs.
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    tokens = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(0))
    hf_dir = tmp_path / "hf16"
    from_hf = [*CKPT, f"--model.init_from_hf={hf_dir}", f"--job.output_dir={tmp_path / 'hf'}"]
    runs = {"bf16": from_hf, "fp32": [*from_hf, "--train.mixed_precision=fp32"]}
    run_distributed(hf_logits_worker, 1, runs, tokens, str(tmp_path / "ours.pt"))
    ours = torch.load(tmp_path / "ours.pt")
    assert ours["bf16"].dtype == torch.bfloat16 and ours["fp32"].dtype == torch.float32
    hf = {
        dtype: transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=dtype, attn_implementation="eager"
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    with torch.no_grad():
        ref, theirs = (hf[dtype](tokens).logits for dtype in (torch.float32, torch.bfloat16))

    # Bounds from a model of rounding, not from what one CPU's kernels gave (each instruction
    # set picks its own: 0.016 from transformers' bf16 logits on an AVX-512 machine was 0.045
    # on an AVX2 EPYC, #41). Each op rounds its output once, by at most u of it: u = 2^-8 in
    # bf16, whose sums run in fp32. In fp32 (u = 2^-24) a sum of n products rounds n times
    # too, each by at most u of the terms' absolute sum, which for weights of random sign is
    # about sqrt(n) times the sum: n u an op. A logit passes about 20 roundings a block
    # (norms, projections, q/k norms, RoPE's three, attention, residual adds; the expert's
    # gate/up, SiLU, product, down, weight and sum), then the final norm and the head:
    # N = 20 L + 2 = 82. Independent roundings add in quadrature (probabilistic rounding
    # error analysis, Higham and Mary 2019), and RMSNorm and the head rescale a norm-wise
    # error without growing it, so ||error|| / ||logits|| <= sqrt(N) u: 9.1 u = 0.035 in bf16
    # (measured on the AVX2 EPYC: ours 2.1 u, transformers' 1.4 u), and with n = 256, the
    # widest sum, 1.4e-4 in fp32 (ours: 2.4e-7). A near tie that the rounding breaks the
    # other way sends a token to another expert (one token on each side here): a few percent
    # of that token's logits, about 1 u over all 96 tokens'.
    config = json.loads((hf_dir / "config.json").read_text())
    roundings = 20 * config["num_hidden_layers"] + 2
    widest = max(config["hidden_size"], config["intermediate_size"])
    bound16, bound32 = roundings**0.5 * U_BF16, roundings**0.5 * widest * U_FP32
    # The weights as we load them, sharply: our fp32 compute against transformers'.
    errors = {"ours fp32": _rel(ours["fp32"], ref)}
    assert errors["ours fp32"] <= bound32, errors
    errors |= {"ours bf16": _rel(ours["bf16"], ref), "transformers bf16": _rel(theirs, ref)}
    assert errors["ours bf16"] <= bound16 and errors["transformers bf16"] <= bound16, errors
    # And ours computed in bf16: fp32 compute rounded only at its logits would be one rounding
    # of the reference away (f, taken from the reference itself: 0.43 u). Ours also rounds
    # the final norm's output, which the head passes on at its size: sqrt(2) f at the least
    # (measured 4.9 f here, and 1.8 f the least over other tokens and trained weights).
    one_rounding = _rel(ref.bfloat16(), ref)
    assert errors["ours bf16"] >= 1.25 * one_rounding, (errors, one_rounding)
    print(f"logits against transformers' fp32, norm-wise: {errors}; bounds {bound16:.3g} "
          f"(bf16), {bound32:.3g} (fp32), at least {1.25 * one_rounding:.3g} (bf16)")  # fmt: skip

    # What the bounds catch, on transformers' own models: two experts' weights swapped (a
    # wrong mapping) exceed the fp32 bound, a transposed projection the bf16 one, and fp32
    # compute rounded at the end stays under the least a bf16 model shows.
    with torch.no_grad():
        experts = hf[torch.float32].model.layers[-1].mlp.experts
        for w in (experts.gate_up_proj, experts.down_proj):
            w[[0, 1]] = w[[1, 0]]
        assert _rel(hf[torch.float32](tokens).logits, ref) > bound32
        o_proj = hf[torch.bfloat16].model.layers[-1].self_attn.o_proj.weight
        o_proj.copy_(o_proj.T.clone())
        assert _rel(hf[torch.bfloat16](tokens).logits, ref) > bound16
    assert _rel(ours["fp32"].bfloat16(), ref) < 1.25 * one_rounding
