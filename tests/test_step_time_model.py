"""`python -m trainer.dry_run --search`: the step-time model's ranking follows from the
bytes and FLOPs it prints, recomputed here from the documented formula (docs/architecture.md,
"Step-time model"), and faster links never make a layout slower."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.distributed import ROOT
from trainer.dry_run.search import Hardware, estimate

GB = 1e9
SEARCH = ["--world-size=4", "--config=configs/debug_qwen3_moe.toml",
          "--train.global_batch_size=4", "--train.micro_batch_size=1", "--search", "--ranks-per-node=2", "--gpu-memory=1"]  # fmt: skip


def _search(tmp_path) -> dict:
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "trainer.dry_run", *SEARCH, f"--json={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "fastest layouts that fit" in proc.stdout
    return json.loads(out.read_text())


def _expected(r: dict, hw: dict, tokens: int, world: int, flops_per_token: float) -> dict:
    """The documented model, written out again from the printed figures."""
    node = hw["ranks_per_node"]
    link = lambda n: (hw["intra_gbps"] if n <= node else hw["inter_gbps"]) * GB  # noqa: E731
    full = r["activation_checkpoint"] == "full"
    flops = flops_per_token * tokens / world * (4 / 3 if full else 1)
    compute = flops / (hw["tflops"] * 1e12 * hw["efficiency"])
    c, n, rep = r["comm_bytes"], r["dp_shard"] * r["cp"], r["dp_replicate"]
    fsdp = (c["fsdp_all_gather"] + c["fsdp_reduce_scatter"]) * (n - 1) / n / link(n)
    hsdp = c["hsdp_all_reduce"] * 2 * (rep - 1) / rep / link(n * rep)
    ring = c["cp_ring_full_ac" if full else "cp_ring"] / link(r["cp"])
    a2a_bytes = c["ep_all_to_all_full_ac" if full else "ep_all_to_all"]
    if r["ep"] > node:
        remote = (r["ep"] - node) / (r["ep"] - 1)
        # two stages: a token crosses once per remote node it has experts on; under uniform
        # routing a node of E/n experts is missed by all k picks with C(E - E/n, k) / C(E, k)
        e, k, nodes = r["experts"], r["top_k"], r["ep"] // node
        missed = math.comb(e - e // nodes, k) / math.comb(e, k)
        across = a2a_bytes * remote * nodes * (1 - missed) / k
        a2a = (a2a_bytes * (1 - remote) + across) / link(1) + across / link(node + 1)
    else:
        a2a = a2a_bytes / link(1)
    step = compute + a2a + max(0.0, fsdp + hsdp + ring - compute)
    return {"flops": flops, "compute": compute, "step": step, "tokens_per_s": tokens / step}


@pytest.mark.slow
def test_search_ranks_by_the_step_time_its_printed_figures_give(tmp_path):
    plan = _search(tmp_path)
    hw, ranked = plan["hardware"], plan["search"]
    assert len(ranked) > 4
    world, tokens = 4, 4 * 128  # global batch x seq_len of the debug config
    rates = [r["tokens_per_s"] for r in ranked]
    assert rates == sorted(rates, reverse=True)
    assert all(r["peak"] <= 1 * 2**30 for r in ranked)
    for r in ranked:
        want = _expected(r, hw, tokens, world, plan["flops_per_token"])
        assert r["flops_per_rank"] == pytest.approx(want["flops"], rel=1e-12)
        assert r["compute_s"] == pytest.approx(want["compute"], rel=1e-12)
        assert r["step_s"] == pytest.approx(want["step"], rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(want["tokens_per_s"], rel=1e-12)
    # Layouts spanning the two simulated nodes pay the slower link: with it 10x faster, no
    # layout gets slower and one whose traffic crosses nodes gets faster.
    hardware = Hardware(**hw)
    faster = dataclasses.replace(hardware, inter_gbps=10 * hardware.inter_gbps)
    sped_up = 0
    for r in ranked:
        layout = _layout(r, tokens)
        mode, flops = r["activation_checkpoint"], plan["flops_per_token"]
        assert estimate(layout, mode, flops, hardware)["step_s"] == r["step_s"]
        fast = estimate(layout, mode, flops, faster)["tokens_per_s"]
        assert fast >= r["tokens_per_s"] * (1 - 1e-12)
        sped_up += fast > 1.01 * r["tokens_per_s"]
    assert sped_up > 0


def _layout(r: dict, tokens: int) -> SimpleNamespace:
    """What `estimate` reads of a measured layout, from a printed entry."""
    world = r["dp_replicate"] * r["dp_shard"] * r["cp"]
    dims = SimpleNamespace(
        world_size=world, **{k: r[k] for k in ("dp_replicate", "dp_shard", "cp", "ep")}
    )
    train = SimpleNamespace(global_batch_size=tokens // 128)
    cfg = SimpleNamespace(train=train, data=SimpleNamespace(seq_len=128),
                          parallel=SimpleNamespace(fsdp_gather="micro_batch"))  # fmt: skip
    return SimpleNamespace(
        cfg=cfg, dims=dims, comm=r["comm_bytes"], experts=r["experts"], top_k=r["top_k"]
    )


def _key(r: dict) -> tuple:
    return tuple(r[k] for k in ("dp_replicate", "dp_shard", "cp", "ep", "micro_batch_size",
                                "activation_checkpoint"))  # fmt: skip
