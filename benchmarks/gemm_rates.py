"""Measured GEMM and attention rates at a model's own shapes, for the step-time model.

    python benchmarks/gemm_rates.py --config configs/qwen3_30b_a3b.toml [--section.key=value ...]
        [--tokens N] [--ep N] [--hardware h100] [--peak-tflops F] [--warmup K] [--iters M]
        [--json FILE] [--tiny]
    python -m moetrain.planner ... --gemm-rates FILE       (the planner, at these rates)

The shapes come from the model the config builds (on the meta device), not from a list
kept here: every `nn.Linear` (projections, dense and shared-expert MLPs, the head; a tied
head as the embedding's matrix), every MoE router (in fp32, as `TopKRouter` runs it) and
every routed-expert weight stack `[E, out, in]`, each with the number of times the model
holds it. At `--tokens` rows (default: micro-batch x seq_len / cp, one rank's tokens), each
distinct GEMM is timed forward and backward (autograd's dgrad and wgrad, as training runs
them) with CUDA events after --warmup calls (3), median of --iters (20). The routed experts go
through the project's grouped GEMM (`moetrain.models.common.grouped_gemm.grouped_mm`: torch._grouped_mm)
at balanced routing: tokens x top_k rows spread evenly over E / --ep experts; next to
each, one dense GEMM of the same FLOPs. Attention: the model's own `AttentionCore` (SDPA,
causal; a window or sinks take its masked path) at micro-batch x seq_len, whatever --tokens
says, its FLOPs counted as the model counts them
(`moetrain.models.common.flops`: no causal discount), so that its efficiency is what the planner's
count needs, and may read up to twice the kernel's own.

Per kind (dense, grouped, attention) the efficiency is the model's FLOPs of that kind over
the time its shapes take, each weighted by how often the model runs it, over the peak:
the FLOP-weighted harmonic mean of the shapes' rates, which is what a sum of times needs.
Prints one JSON object (or writes --json FILE), then a one-line summary. --tiny: the
model's debug config (configs/debug_<model>.toml) in fp32 on the CPU, two timed calls: the
code path, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_result  # noqa: E402
from moetrain.models.common.attention import AttentionCore  # noqa: E402
from moetrain.models.common.flops import KINDS  # noqa: E402
from moetrain.models.common.grouped_gemm import grouped_mm, grouped_mm_supported  # noqa: E402
from moetrain.models.common.moe import MoE  # noqa: E402
from moetrain.planner.search import PRESETS, flops_per_token  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# About 50 ms at an H100's clock: more than the host takes to launch the timed calls.
SLEEP_CYCLES = 10**8


def role(name: str) -> str:
    """A module's name with its layer indices as `*`: one role per kind of layer."""
    return re.sub(r"(?<![^.])\d+(?=\.|$)", "*", name)


def gemm_shapes(model: nn.Module, tokens: int, ep: int, dtype: str) -> list[dict]:
    """Every matmul with a weight, as {kind, role, count, m, k, n, groups, dtype, bias}."""
    found: dict[tuple, dict] = {}

    def add(kind, name, m, k, n, groups=1, dt=dtype, bias=False):
        key = (kind, role(name), m, k, n, groups, dt, bias)
        fields = ("kind", "role", "m", "k", "n", "groups", "dtype", "bias")
        entry = found.setdefault(key, dict(zip(fields, key, strict=True)))
        entry["count"] = entry.get("count", 0) + 1

    for name, module in model.named_modules():
        if isinstance(module, MoE):
            for pname, p in module.experts.named_parameters(recurse=False):
                if p.dim() == 3:  # a stacked [E, out, in] weight: one grouped GEMM
                    rows, groups = tokens * module.top_k, module.num_experts // ep
                    add("grouped", f"{name}.experts.{pname}", rows, p.shape[2], p.shape[1], groups)
            w = module.gate.weight  # the router multiplies in fp32 (`x.float()`)
            bias = getattr(module.gate, "bias", None) is not None
            add("dense", f"{name}.gate", tokens, w.shape[1], w.shape[0], dt="fp32", bias=bias)
        elif isinstance(module, nn.Linear):
            add("dense", name, tokens, module.in_features, module.out_features,
                bias=module.bias is not None)  # fmt: skip
    tied = getattr(model, "lm_head", "untied") is None  # the head is the embedding's matrix
    # DeepSeek-V3's MTP depths each run the output head once more (its spec counts them)
    for _ in range(1 + len(getattr(model, "mtp", None) or ())):
        if tied:
            vocab, dim = model.embed_tokens.weight.shape
            add("dense", "embed_tokens (tied head)", tokens, dim, vocab)
        elif _ and isinstance(getattr(model, "lm_head", None), nn.Linear):
            head = model.lm_head
            add("dense", "lm_head", tokens, head.in_features, head.out_features)
    return list(found.values())


class _Seen(Exception):
    pass


def attention_shapes(model: nn.Module, batch: int, seq: int, dtype: str) -> list[dict]:
    """The attention cores, one entry per variant (window, sinks) with its count. The
    head counts and widths are read off the model's first core call on the meta device
    (MLA, GQA and plain attention alike), the forward stopped right there."""
    heads = {}

    def catch(module, args):
        q, k, v = args[:3]  # [B, S, H, D]
        heads.update(hq=q.shape[2], hkv=k.shape[2], dqk=q.shape[3], dv=v.shape[3])
        raise _Seen

    cores = [(n, m) for n, m in model.named_modules() if isinstance(m, AttentionCore)]
    if not cores:
        return []
    handle = cores[0][1].register_forward_pre_hook(catch)
    try:
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    except _Seen:
        pass
    finally:
        handle.remove()
    found: dict[tuple, dict] = {}
    for name, core in cores:
        parent = model.get_submodule(name.rpartition(".")[0])
        sinks = isinstance(getattr(parent, "sinks", None), nn.Parameter)
        key = (role(name), core.window, sinks)
        entry = found.setdefault(key, {"kind": "attention", "role": key[0], "batch": batch,
                                       "seq": seq, **heads, "window": core.window,
                                       "sinks": sinks, "causal": core.causal, "scale": core.scale,
                                       "dtype": dtype, "count": 0})  # fmt: skip
        entry["count"] += 1
    return list(found.values())


def timer(device: torch.device, warmup: int, iters: int):
    """fn -> median seconds of `iters` calls after `warmup` untimed ones. On a GPU, by CUDA
    events around each call, all queued behind a sleeping kernel: the host has launched
    them all before the GPU gets to the first, so the events time the kernels, back to
    back, and not the host's launches (a small GEMM takes less than its launch)."""

    def run(fn) -> float:
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        events = []
        torch.cuda._sleep(SLEEP_CYCLES)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3

    return run


def fwd_bwd(run, forward, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds of `forward()` (building its graph, as training does) and of its backward
    (the gradients of all `inputs`; the graph kept for the next timed call)."""
    fwd = run(forward)
    y = forward()
    grad = torch.randn_like(y)
    bwd = run(lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True))
    return fwd, bwd


def _rand(*shape, dtype, device, scale=1.0):
    # in place: an expert stack can be a fifth of the GPU (DeepSeek-V3's: 15 GB)
    return torch.randn(*shape, dtype=dtype, device=device).mul_(scale).requires_grad_()


def time_linear(run, m, k, n, dtype, bias, device) -> tuple[float, float]:
    x = _rand(m, k, dtype=dtype, device=device)
    w = _rand(n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = _rand(n, dtype=dtype, device=device) if bias else None
    return fwd_bwd(run, lambda: F.linear(x, w, b), [x, w] + ([b] if bias else []))


def time_grouped(run, m, k, n, groups, dtype, device) -> tuple[float, float, str]:
    """The experts' GEMM as `GroupedExperts.ffn` runs it: rows expert-major, the stacked
    [E, out, in] parameter transposed, balanced counts."""
    x = _rand(m, k, dtype=dtype, device=device)
    stack = _rand(groups, n, k, dtype=dtype, device=device, scale=k**-0.5)
    counts = torch.full((groups,), m // groups, dtype=torch.int64)
    counts[: m % groups] += 1
    counts = counts.to(device)
    impl = "grouped_mm" if grouped_mm_supported(x, stack.transpose(-2, -1)) else "loop"
    fwd, bwd = fwd_bwd(run, lambda: grouped_mm(x, stack.transpose(-2, -1), counts), [x, stack])
    return fwd, bwd, impl


def time_attention(run, e: dict, device) -> tuple[float, float]:
    dtype = DTYPES[e["dtype"]]
    b, s = e["batch"], e["seq"]
    q = _rand(b, s, e["hq"], e["dqk"], dtype=dtype, device=device)
    k = _rand(b, s, e["hkv"], e["dqk"], dtype=dtype, device=device)
    v = _rand(b, s, e["hkv"], e["dv"], dtype=dtype, device=device)
    sinks = _rand(e["hq"], dtype=torch.float32, device=device) if e["sinks"] else None
    core = AttentionCore(e["scale"], e["causal"], e["window"])
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    return fwd_bwd(run, lambda: core(q, k, v, None, sinks), inputs)


def attention_flops(e: dict) -> float:
    """Training FLOPs of one core call as the model counts them: 6 x heads x (qk + v
    width) x the keys a query sees (the window's, at most), per token."""
    keys = min(e["window"], e["seq"]) if e["window"] else e["seq"]
    return 6 * e["hq"] * (e["dqk"] + e["dv"]) * keys * e["batch"] * e["seq"]


def _rates(flops: float, fwd: float, bwd: float, peak: float) -> dict:
    return {"fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
            "fwd_tflops": flops / 3 / fwd / 1e12, "bwd_tflops": flops * 2 / 3 / bwd / 1e12,
            "tflops": flops / (fwd + bwd) / 1e12,
            "fraction_of_peak": flops / (fwd + bwd) / 1e12 / peak}  # fmt: skip


def _time(e: dict, run, device) -> tuple:
    """(fwd s, bwd s, grouped GEMM impl or None, the equal-FLOPs dense (fwd, bwd) or None)."""
    dtype = DTYPES[e["dtype"]]
    if e["kind"] == "attention":
        return (*time_attention(run, e, device), None, None)
    if e["kind"] == "dense":
        return (*time_linear(run, e["m"], e["k"], e["n"], dtype, e["bias"], device), None, None)
    fwd, bwd, impl = time_grouped(run, e["m"], e["k"], e["n"], e["groups"], dtype, device)
    # a dense GEMM of the same FLOPs: what the grouping itself costs
    return fwd, bwd, impl, time_linear(run, e["m"], e["k"], e["n"], dtype, False, device)


def measure(entries: list[dict], run, device, peak: float, log) -> None:
    """Time each entry in place (a GEMM the model holds under several roles, once). A shape
    that fails (out of memory, a kernel's limit) gets its error and no rate; the others
    still count."""
    seen: dict[tuple, tuple | str] = {}
    for e in entries:
        if e["kind"] == "attention":
            key = ("attention", e["window"], e["sinks"])
            e["flops"] = attention_flops(e)
        else:
            key = tuple(e[f] for f in ("kind", "m", "k", "n", "groups", "dtype", "bias"))
            e["flops"] = 6 * e["m"] * e["k"] * e["n"]  # forward 2, backward 4 per MAC
        if key not in seen:
            try:
                seen[key] = _time(e, run, device)
            except RuntimeError as err:  # torch.OutOfMemoryError is one
                seen[key] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next shape's weights may be large (E stacks)
        label = e["role"] + (f" (window {e['window']})" if e.get("window") else "")
        if isinstance(seen[key], str):
            e["error"] = seen[key]
            log(f"  {e['kind']:<9} {label:<44} x{e['count']:<3} failed: {e['error']}")
            continue
        fwd, bwd, impl, dense = seen[key]
        e.update(_rates(e["flops"], fwd, bwd, peak))
        if impl is not None:
            eq = _rates(e["flops"], *dense, peak)
            e.update(impl=impl, dense_equal_flops=eq, grouped_over_dense=e["tflops"] / eq["tflops"])
        log(f"  {e['kind']:<9} {label:<44} x{e['count']:<3} {e['tflops']:8.3g} TFLOP/s "
            f"({100 * e['fraction_of_peak']:.3g}% of peak)")  # fmt: skip


def by_kind(entries: list[dict], peak: float, model_split: dict | None) -> dict:
    """Per kind: FLOPs and seconds of one micro-batch (each shape times its count), the
    rate, the efficiency, and the FLOPs per token against the model's own split (how much
    of the model's count these shapes cover)."""
    out = {}
    for kind in KINDS:
        mine = [e for e in entries if e["kind"] == kind and "error" not in e]
        if not mine:
            continue
        flops = sum(e["count"] * e["flops"] for e in mine)
        seconds = sum(e["count"] * (e["fwd_ms"] + e["bwd_ms"]) / 1e3 for e in mine)
        per_token = sum(e["count"] * e["flops"] / e["tokens"] for e in mine)
        c = {"flops": flops, "seconds": seconds, "tflops": flops / seconds / 1e12,
             "efficiency": flops / seconds / 1e12 / peak, "flops_per_token": per_token}  # fmt: skip
        failed = [e["role"] for e in entries if e["kind"] == kind and "error" in e]
        if failed:  # the efficiency is the measured shapes'; coverage says what is left out
            c["failed"] = failed
        if model_split and model_split.get(kind):
            c["model_flops_per_token"] = model_split[kind]
            c["coverage"] = per_token / model_split[kind]
        if kind == "grouped":
            eq = [e["dense_equal_flops"] for e in mine]
            dense_s = sum(e["count"] * (q["fwd_ms"] + q["bwd_ms"]) / 1e3 for e, q in zip(mine, eq))
            c["dense_equal_flops_efficiency"] = flops / dense_s / 1e12 / peak
        out[kind] = c
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, help="rows of the GEMMs (default: one rank's)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism: E / ep groups")
    parser.add_argument("--hardware", choices=sorted(PRESETS), default="h100")
    parser.add_argument("--peak-tflops", type=float, help="default: the --hardware preset's")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--json", help="write the JSON here (default: stdout)")
    parser.add_argument("--tiny", action="store_true", help="the debug config, fp32, on CPU")
    args, rest = parser.parse_known_args(argv)  # the rest: --config and its overrides

    from moetrain.config import load_config
    from moetrain.models import get_model_spec

    cfg = load_config(rest)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        # the real model's overrides would not fit the debug one: its own values alone
        cfg = load_config(
            ["--config", os.path.join(ROOT, "configs", f"debug_{cfg.model.name}.toml")]
        )
        args.dtype, args.warmup, args.iters = "fp32", 1, 2
    peak = args.peak_tflops or PRESETS[args.hardware].tflops
    batch, seq, cp = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.parallel.cp
    tokens = args.tokens or batch * seq // cp
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg.model.args)
    entries = gemm_shapes(model, tokens, args.ep, args.dtype)
    for e in entries:
        e["tokens"] = tokens
    for e in attention_shapes(model, batch, seq, args.dtype):
        entries.append({**e, "tokens": batch * seq})
    split = getattr(flops_per_token(cfg), "by_kind", None)
    del model

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731  (stdout: the JSON)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    log(f"{cfg.model.name}: {len(entries)} shapes at {tokens} tokens on {name}, {args.dtype}")
    measure(entries, timer(device, args.warmup, args.iters), device, peak, log)
    kinds = by_kind(entries, peak, split)
    result = {"benchmark": "gemm_rates", "model": cfg.model.name, "device": name,
              "torch": torch.__version__, "dtype": args.dtype, "tiny": args.tiny,
              "overrides": rest, "tokens_per_rank": tokens, "micro_batch": batch,
              "seq_len": seq, "cp": cp, "ep": args.ep, "peak_tflops": peak,
              "warmup": args.warmup, "iters": args.iters, "categories": kinds,
              "shapes": entries}  # fmt: skip
    write_result(result, args.json)
    parts = [
        f"{k} {100 * c['efficiency']:.3g}% ({c['tflops']:.3g} TFLOP/s)" for k, c in kinds.items()
    ]
    if "grouped" in kinds:
        dense_eq = kinds["grouped"]["dense_equal_flops_efficiency"]
        parts[list(kinds).index("grouped")] += f" vs {100 * dense_eq:.3g}% dense at equal FLOPs"
    print(f"gemm_rates {cfg.model.name}, {tokens} tokens/rank, ep {args.ep}, {args.dtype} on "
          f"{name} (peak {peak:g} TFLOP/s): {'; '.join(parts)}")  # fmt: skip


if __name__ == "__main__":
    main()
