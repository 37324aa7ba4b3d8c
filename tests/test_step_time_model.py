"""`python -m moetrain.planner --search`: the step-time model's ranking follows from the
bytes and FLOPs it prints, recomputed here from the documented formula (docs/planner.md,
"Step-time model"), and faster links never make a layout slower. With `--gemm-rates FILE`
(measured efficiency per kind of kernel, `benchmarks/gemm_rates.py`) the compute is each
kind's FLOPs at its own efficiency, recomputed from a hand-written file and a FLOP split
counted here from the config's values."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from moetrain.parallelisms.dims import ParallelDims
from moetrain.planner.recompute_cost import GemmFlops
from moetrain.planner.search import Hardware, estimate, rates_by_kind, read_rates
from tests.distributed import ROOT

GB = 1e9
SEARCH = ["--world-size=4", "--config=configs/debug_qwen3_moe.toml",
          "--train.global_batch_size=4", "--train.micro_batch_size=1", "--search", "--ranks-per-node=2", "--gpu-memory=1",
          "--memory-reserve=0"]  # fmt: skip
# A rates file as benchmarks/gemm_rates.py writes it, written by hand; its efficiencies are
# fractions of half the H100 preset's peak, which the planner converts to its own.
RATES = {"model": "qwen3_moe", "peak_tflops": 989 / 2,
         "categories": {"dense": {"efficiency": 0.6}, "grouped": {"efficiency": 0.25},
                        "attention": {"efficiency": 0.4}}}  # fmt: skip


def _debug_flops_by_kind() -> dict:
    """Training FLOPs per token of configs/debug_qwen3_moe.toml by kind, counted from its
    values: 4 blocks (the first dense), hidden 128, 4 heads x 32 (2 KV heads), 8 experts
    of width 64, top-2, dense width 256, vocab 320 (an untied head), seq 128."""
    attn_proj = 128 * 4 * 32 * 2 + 128 * 2 * 32 * 2  # q and o, k and v
    norms = 2 * 32 + 2 * 128  # q/k norms per head, the block's two norms
    # + the 3 routers, the dense block's MLP, the final norm and the head
    dense = 4 * (attn_proj + norms) + 3 * 8 * 128 + 3 * 128 * 256 + 128 + 320 * 128
    grouped = 3 * 8 * (3 * 128 * 64) * 2 / 8
    return {"dense": 6 * dense, "grouped": 6 * grouped, "attention": 6 * 4 * 4 * (32 + 32) * 128}


def _search(tmp_path) -> dict:
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "moetrain.planner", *SEARCH, f"--json={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "fastest layouts that fit" in proc.stdout
    return json.loads(out.read_text())


def _expected(
    r: dict, hw: dict, tokens: int, world: int, flops_per_token: float, rates: dict | None = None
) -> dict:
    """The documented model, written out again from the printed figures; with `rates` (a
    rates file) the compute by kind, from the FLOPs counted by `_debug_flops_by_kind`."""
    node = hw["ranks_per_node"]
    link = lambda n: (hw["intra_gbps"] if n <= node else hw["inter_gbps"]) * GB  # noqa: E731
    full = r["activation_checkpoint"] == "full"
    # `selective` runs its regions' GEMMs again (Qwen3-MoE: the experts' down-projection),
    # in backward, where no all-to-all of theirs runs: added after the overlap below
    again = r.get("recomputed_flops_per_token", 0.0) * tokens / world
    flops = flops_per_token * tokens / world * (4 / 3 if full else 1)
    compute = flops / (hw["tflops"] * 1e12 * hw["efficiency"])
    again_s = again / (hw["tflops"] * 1e12 * hw["efficiency"])
    flops += again
    if rates is not None:
        per_rank = tokens / world * (4 / 3 if full else 1)
        compute = sum(
            f * per_rank / (rates["peak_tflops"] * 1e12 * rates["categories"][k]["efficiency"])
            for k, f in _debug_flops_by_kind().items()
        )
        # (the recomputation as printed, one kind: `_layout` calls it dense)
        dense = rates["categories"]["dense"]["efficiency"]
        again_s = again / (rates["peak_tflops"] * 1e12 * dense)
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
    # parallel.ep_overlap: per pass (each forward, the replay's too, and the backward, which
    # computes twice a forward), a transfer hides under what runs between its issue and its
    # wait. This model has no shared experts, so `shared` hides nothing; `chunks` hides B's
    # dispatch (a quarter of the pass) under A's experts and both combines (a half) under
    # B's experts. The experts' share of the compute: of the FLOPs, or with rates, the time.
    split = _debug_flops_by_kind()
    if rates is None:
        experts_share = split["grouped"] / sum(split.values())
    else:
        grouped = split["grouped"] * per_rank / (rates["peak_tflops"] * 1e12 * rates["categories"]["grouped"]["efficiency"])  # fmt: skip
        experts_share = grouped / compute
    forwards = 2 if full else 1
    experts = compute / (forwards + 2) * experts_share  # in one forward
    hidden = 0.0
    if r.get("ep_overlap") == "chunks":
        one = a2a / (forwards + 1)
        for e in [experts] * forwards + [2 * experts]:
            hidden += min(one / 4, e / 2) + min(one / 2, e / 2)
    # the optimizer step: the state it streams at the GPU's memory bandwidth
    optimizer = c["optimizer_memory"] / (hw["memory_gbps"] * GB)
    compute += again_s
    step = compute + a2a - hidden + max(0.0, fsdp + hsdp + ring - compute) + optimizer
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
    # Pipeline stages: the step is the schedule's span (tests/test_pipeline_cost.py) plus
    # the FSDP traffic it leaves exposed; the bubble is idle time inside the span.
    staged = [r for r in ranked if r["pp"] > 1]
    assert staged and {r["pp_schedule"] for r in staged} >= {"1F1B", "ZBVZeroBubble"}
    for r in staged:
        span = r["pipeline_span_s"] + r["exposed_background_s"]
        assert r["step_s"] == pytest.approx(span + r["optimizer_s"])
        assert 0 <= r["bubble_s"] < r["pipeline_span_s"]
    ranked = [r for r in ranked if r["pp"] == 1]  # the closed form below
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
    sped_up = hidden = 0
    for r in ranked:
        layout = _layout(r, tokens)
        mode, flops = r["activation_checkpoint"], _with_split(plan["flops_per_token"])
        assert estimate(layout, mode, flops, hardware)["step_s"] == r["step_s"]
        if r["ep"] > 1:  # the search kept the fastest way to overlap the all-to-all
            for form in ("none", "shared", "chunks"):
                other = estimate(layout, mode, flops, hardware, overlap=form)["tokens_per_s"]
                assert other <= r["tokens_per_s"]
            hidden += r["ep_hidden_s"] > 0
        fast = estimate(layout, mode, flops, faster)["tokens_per_s"]
        assert fast >= r["tokens_per_s"] * (1 - 1e-12)
        sped_up += fast > 1.01 * r["tokens_per_s"]
    assert sped_up > 0 and hidden > 0
    # Measured rates instead of the constant: each layout's compute by kind, as written out.
    flops = _with_split(plan["flops_per_token"])
    (tmp_path / "rates.json").write_text(json.dumps(RATES))
    by_kind = rates_by_kind(read_rates(str(tmp_path / "rates.json")), flops, hardware)
    for r in ranked:
        est = estimate(_layout(r, tokens), r["activation_checkpoint"], flops, hardware, by_kind)
        want = _expected(r, hw, tokens, world, flops, RATES)
        assert est["compute_s"] == pytest.approx(want["compute"], rel=1e-12)
        assert est["step_s"] == pytest.approx(want["step"], rel=1e-12)


def test_measured_rates_give_each_kind_its_own_efficiency(tmp_path):
    rates, out = tmp_path / "rates.json", tmp_path / "plan.json"
    rates.write_text(json.dumps(RATES))
    args = [a for a in SEARCH if a != "--search"]
    cmd = [sys.executable, "-m", "moetrain.planner", *args, "--train.activation_checkpoint=full",
           f"--gemm-rates={rates}", f"--json={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    effs = "dense 0.3, grouped 0.125, attention 0.2"  # the file's, at the planner's peak
    assert f"989 TFLOP/s x measured efficiency ({effs}: {rates}, qwen3_moe)" in proc.stdout
    plan = json.loads(out.read_text())
    split = plan["gemm_rates"]["flops_by_kind"]
    assert split == pytest.approx(_debug_flops_by_kind(), rel=1e-12)
    assert sum(split.values()) == pytest.approx(plan["flops_per_token"], rel=1e-12)
    est = plan["estimate"]
    r = {**plan["layout"], **est, "activation_checkpoint": "full", "comm_bytes": plan["per_step"]}
    want = _expected(r, plan["hardware"], 4 * 128, 4, plan["flops_per_token"], RATES)
    assert est["compute_s"] == pytest.approx(want["compute"], rel=1e-12)
    assert est["step_s"] == pytest.approx(want["step"], rel=1e-12)


def test_a_rates_file_without_a_kind_the_model_has_is_refused(tmp_path):
    from moetrain.config import ConfigError
    from moetrain.planner.search import PRESETS

    rates = tmp_path / "rates.json"
    kinds = {k: v for k, v in RATES["categories"].items() if k != "grouped"}
    rates.write_text(json.dumps({**RATES, "categories": kinds}))
    flops = _with_split(sum(_debug_flops_by_kind().values()))
    with pytest.raises(ConfigError, match="no efficiency for grouped"):
        rates_by_kind(read_rates(str(rates)), flops, PRESETS["h100"])
    rates.write_text("{}")
    with pytest.raises(ConfigError, match="not the JSON of benchmarks/gemm_rates.py"):
        read_rates(str(rates))


def _with_split(total: float):
    from moetrain.models.common.flops import FlopsPerToken

    return FlopsPerToken(total, _debug_flops_by_kind())


def _layout(r: dict, tokens: int) -> SimpleNamespace:
    """What `estimate` reads of a measured layout, from a printed entry."""
    world = r["dp_replicate"] * r["dp_shard"] * r["cp"]
    dims = ParallelDims.resolve(*(r[k] for k in ("dp_replicate", "dp_shard", "cp", "ep")), world)
    train = SimpleNamespace(global_batch_size=tokens // 128, fp8="none")
    cfg = SimpleNamespace(train=train, data=SimpleNamespace(seq_len=128),
                          parallel=SimpleNamespace(fsdp_gather="micro_batch",
                                                   ep_overlap=r["ep_overlap"]))  # fmt: skip
    # the selective recomputation's FLOPs as printed (Qwen3-MoE: its experts'
    # down-projection; one kind is enough at one efficiency)
    again = GemmFlops({"dense": r.get("recomputed_flops_per_token", 0.0)}, {})
    activations = {"selective": SimpleNamespace(gemm_flops=again)}
    return SimpleNamespace(
        cfg=cfg,
        dims=dims,
        activations=activations,
        comm=r["comm_bytes"],
        experts=r["experts"],
        top_k=r["top_k"],
        pipeline=None,
        routing_groups=None,  # Qwen3-MoE routes over all its experts
        reference=None,  # train.objective=sft: no DPO reference
    )


def _key(r: dict) -> tuple:
    return tuple(r[k] for k in ("dp_replicate", "dp_shard", "cp", "ep", "micro_batch_size",
                                "activation_checkpoint"))  # fmt: skip


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_rates_benchmark_times_the_matmuls_the_model_counts(model):
    """benchmarks/gemm_rates.py reads its shapes off the built model; weighted by how often
    the model runs each, their FLOPs per token are the model's split by kind: the dense
    ones short of the norms' (no GEMM), the grouped ones of GPT-OSS's expert biases."""
    import torch

    from benchmarks.gemm_rates import attention_flops, attention_shapes, gemm_shapes
    from moetrain.config import load_config
    from moetrain.models import get_model_spec
    from moetrain.models.common.moe import MoE
    from moetrain.planner.search import flops_per_token

    cfg = load_config(["--config", f"{ROOT}/configs/debug_{model}.toml"])
    split, seq, tokens = flops_per_token(cfg).by_kind, cfg.data.seq_len, 64
    spec = get_model_spec(model)
    with torch.device("meta"):
        built = spec.build(cfg.model.args)
    gemms = gemm_shapes(built, tokens, 1, "bf16")
    timed = {k: sum(6 * e["m"] * e["k"] * e["n"] * e["count"] for e in gemms if e["kind"] == k)
             / tokens for k in ("dense", "grouped")}  # fmt: skip
    cores = attention_shapes(built, 2, seq, "bf16")
    timed["attention"] = sum(attention_flops(e) * e["count"] for e in cores) / (2 * seq)
    assert timed["attention"] == pytest.approx(split["attention"], rel=1e-12)
    for kind in ("dense", "grouped"):
        assert 0.98 < timed[kind] / split[kind] <= 1 + 1e-12
    # under ep 2 each rank's grouped GEMM holds half the experts
    halves = {m.num_experts // 2 for m in built.modules() if isinstance(m, MoE)}
    ep2 = gemm_shapes(built, tokens, 2, "bf16")
    assert {e["groups"] for e in ep2 if e["kind"] == "grouped"} == halves


def _reuse_worker(_rank: int, _world_size: int, out: str) -> None:
    """Every search candidate of the debug config on 4 ranks, measured with the search's
    reuse and from nothing: their figures, and how many shardings and traces were run."""
    import copy

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moetrain.config import load_config
    from moetrain.planner.layout_cost import MODES, Measured, measure_layout, peak_bytes
    from moetrain.planner.search import PRESETS, candidates

    cfg = load_config([*SEARCH[1:4], "--parallel.ranks_per_node=2"])
    if dist.is_initialized():  # the harness's gloo group: the planner plays on a fake one
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    hw = dataclasses.replace(PRESETS["h100"], ranks_per_node=2)
    reuse, figures, trials = Measured(), [], []
    tried = candidates(cfg, 4, hw)
    for cand in tried:
        trial = copy.deepcopy(cfg)
        for section, values in cand.items():
            for key, value in values.items():
                setattr(getattr(trial, section), key, value)
        trials.append(trial)
        before = len(reuse.shards)
        shared = measure_layout(trial, 4, reuse=reuse)
        # Measured afresh anyway, or a plain reuse (cp 1): the cp splits are the riskiest.
        if len(reuse.shards) > before or trial.parallel.cp == 1:
            continue
        pair = [shared, measure_layout(trial, 4)]
        figures.append([
            [[peak_bytes(x, m) for m in MODES], x.comm, x.fsdp_buffers,
             [x.activations[m].saved_after_forward for m in MODES]]
            for x in pair
        ])  # fmt: skip
    with open(out, "w") as f:
        json.dump({"figures": figures, "candidates": len(tried), "shards": len(reuse.shards),
                   "traces": len(reuse.traces), "pooled": _pooled(trials, reuse)}, f)  # fmt: skip


def _pooled(trials: list, reuse) -> dict:
    """The search's traces and whole-model shardings measured again, part in a worker
    process and part taken back into this one (moetrain.planner.workers): whether each
    equals this process's own, and where they ran."""
    from moetrain.planner.layout_cost import Measured
    from moetrain.planner.workers import SearchPool, resolved, search_jobs

    pooled = Measured()
    jobs = search_jobs(trials, 4, pooled)
    pool = SearchPool(4, 1)
    try:
        pool.submit(jobs)
        cache, key, _, _ = jobs[0]
        resolved(cache[key])  # the worker has run one at least
        taken = pool.take_back(pooled)
        # vars(): every field, the trace's curve too (its == skips it)
        same = [vars(resolved(pooled.traces[k])) == vars(t) for k, t in reuse.traces.items()]
        same += [
            resolved(pooled.shards[k]) == s for k, s in reuse.shards.items() if k in pooled.shards
        ]
    finally:
        pool.close()
    return {"jobs": len(jobs), "taken_back": taken, "same": same}


@pytest.mark.slow
def test_the_search_measures_each_sharding_and_trace_once_with_the_same_figures(tmp_path):
    from tests.distributed import run_distributed

    out = tmp_path / "reuse.json"
    run_distributed(_reuse_worker, 1, str(out))
    got = json.loads(out.read_text())
    assert got["figures"]
    for shared, fresh in got["figures"]:
        assert shared == fresh
    # Micro-batches and the split of the FSDP group into dp_shard x cp share a sharding,
    # and every degree but cp shares a trace.
    assert got["shards"] < got["candidates"]
    assert got["traces"] < 3 * got["candidates"]
    # In worker processes or taken back into this one, every trace and sharding is the same.
    pooled = got["pooled"]
    assert pooled["same"] and all(pooled["same"])
    assert len(pooled["same"]) == got["traces"] + got["shards"]
    assert 0 < pooled["taken_back"] < pooled["jobs"]


def test_the_overlap_credit_follows_its_rule():
    """`a2a_cost.a2a_hidden` on hand-made figures (one pass: dispatch 4 s, combine 4 s),
    and the shared experts' FLOPs it reads, counted from configs/debug_deepseek_v3.toml."""
    from moetrain.config import load_config
    from moetrain.planner.a2a_cost import a2a_hidden
    from moetrain.planner.search import flops_per_token

    assert a2a_hidden("none", 8.0, 10.0, 10.0) == 0.0
    assert a2a_hidden("shared", 8.0, 10.0, 1.0) == 1.0  # the combine, up to the shared 1 s
    assert a2a_hidden("shared", 8.0, 10.0, 9.0) == 4.0  # ... and at most the combine
    # chunks: B's dispatch (2 s) under A's experts (1 s); the combines (4 s) under B's
    # experts and the shared ones (1 + 1 s)
    assert a2a_hidden("chunks", 8.0, 2.0, 1.0) == 1.0 + 2.0
    assert a2a_hidden("chunks", 8.0, 100.0, 0.0) == 6.0  # all but A's dispatch
    cfg = load_config(["--config", f"{ROOT}/configs/debug_deepseek_v3.toml"])
    # one shared SwiGLU (hidden 128, width 64: 3 matrices) in 3 MoE layers and the MTP one
    assert flops_per_token(cfg).shared_experts == 6 * 4 * 3 * 128 * 64
    qwen = load_config(["--config", f"{ROOT}/configs/debug_qwen3_moe.toml"])
    assert flops_per_token(qwen).shared_experts == 0.0
