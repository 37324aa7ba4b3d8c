"""Ring attention over cp ranks vs one-device attention on the full sequence (fwd + bwd).

    torchrun --nproc_per_node=CP benchmarks/ring_attention.py [--seq=4096 --heads=8
        --kv-heads=2 --head-dim=64 --batch=1 --iters=5 --kernel=auto --layout=zigzag]

Prints one JSON object (rank 0), then a one-line summary. The reference is PyTorch SDPA
on the whole sequence in one process (timed on rank 0 after the ring, alone).

Document masks (packed samples of lognormal document lengths, mean seq/4 by default):

    torchrun --nproc_per_node=CP benchmarks/ring_attention.py --docs [--doc-sigma=1.0]
        times the ring with and without the mask (both on the math kernel, the one that
        takes a mask) and counts the query-key pairs each computes;
    python benchmarks/ring_attention.py --docs-only [--seq=8192 --samples=32]
        no processes: per-rank work under document masks for cp 2, 4, 8 (both layouts),
        from `moetrain.parallelisms.cp_schedule.document_attention_work`, and its balance.

Sliding windows (GPT-OSS): python benchmarks/ring_attention.py --window-only [--seq=32768
--window=128] counts, per cp, the pairs the ring computes against the causal ring's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.parallelisms.context_parallel import RingStats, ring_attention  # noqa: E402
from moetrain.parallelisms.cp_schedule import (  # noqa: E402
    attention_work,
    balanced_table,
    document_attention_work,
    ring_blocks,
    split_for_cp,
)


def lognormal_document_ids(
    seq: int, samples: int, mean: float, sigma: float, seed: int = 0
) -> torch.Tensor:
    """[samples, seq] document ids of packed samples: documents of lognormal lengths (the
    given mean, log-space sigma; at least one token) laid end to end and cut every `seq`
    tokens, numbered from 0 in each sample as the data path numbers them."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2  # so that E[length] = mean
    lengths: list[int] = []
    while sum(lengths) < seq * samples:
        draw = torch.randn(1024, generator=g, dtype=torch.float64) * sigma + mu
        lengths += draw.exp().ceil().long().tolist()
    stream = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ids = stream[: seq * samples].view(samples, seq)
    return ids - ids[:, :1]


def _ring_rectangles(cp: int, seq: int, zigzag: bool) -> list[list[int]]:
    """Pairs the unmasked causal ring computes, [rank][step]: its blocks' full areas."""
    seq_local = seq // cp
    return [
        [
            sum(
                (r.stop - r.start) * (c.stop - c.start)
                for r, c, _ in ring_blocks(rank, (rank - step) % cp, seq_local, True, zigzag)
            )
            for step in range(cp)
        ]
        for rank in range(cp)
    ]


def _balance(per_rank: list[float]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def document_work_report(
    seq: int,
    samples: int,
    sigma: float,
    cps=(2, 4, 8),
    layouts=("zigzag", "contiguous", "balanced"),
) -> list[dict]:
    """Per cp and layout, over `samples` packed samples (one micro-batch row each): the
    max/mean of per-rank visible pairs (the useful work) and of computed pairs, the ring's
    critical path (sum over steps of the slowest rank's computed pairs, over the mean
    rank's total: each hop waits for the neighbour), and the fractions of work removed."""
    ids = lognormal_document_ids(seq, samples, seq / 4, sigma)
    rows = []
    for cp in cps:
        for layout in layouts:
            zigzag = layout in ("zigzag", "balanced")  # balanced: skipped work vs zigzag's
            causal_pairs = sum(attention_work(cp, seq, True, zigzag))
            rect = sum(map(sum, _ring_rectangles(cp, seq, zigzag)))
            seen_bal, done_bal, path, seen_all, done_all = [], [], [], 0, 0
            for sample in ids:
                table = balanced_table(sample[None], cp) if layout == "balanced" else None
                seen, done = document_attention_work(
                    sample[None], cp, True, layout == "zigzag", table=table
                )
                seen_rank, done_rank = [sum(r) for r in seen], [sum(r) for r in done]
                seen_bal.append(_balance(seen_rank))
                done_bal.append(_balance(done_rank))
                slowest = sum(max(done[r][t] for r in range(cp)) for t in range(cp))
                path.append(slowest / (sum(done_rank) / cp))
                seen_all, done_all = seen_all + sum(seen_rank), done_all + sum(done_rank)
            rows.append(
                {
                    "cp": cp,
                    "layout": layout,
                    "visible_max_over_mean": statistics.mean(seen_bal),
                    "visible_max_over_mean_worst": max(seen_bal),
                    "computed_max_over_mean": statistics.mean(done_bal),
                    "ring_critical_path_over_mean": statistics.mean(path),
                    "mask_removes_of_causal_pairs": 1 - seen_all / (causal_pairs * samples),
                    "kernel_work_skipped": 1 - done_all / (rect * samples),
                }
            )
    return rows


def docs_only(args) -> None:
    rows = document_work_report(args.seq, args.samples, args.doc_sigma)
    print(json.dumps({"seq": args.seq, "samples": args.samples, "doc_sigma": args.doc_sigma,
                      "mean_doc_len": args.seq / 4, "rows": rows}))  # fmt: skip
    print(f"document masks, seq {args.seq}, lognormal lengths (mean {args.seq // 4}, "
          f"sigma {args.doc_sigma}), {args.samples} samples; per-rank max/mean:")  # fmt: skip
    for r in rows:
        print(
            f"  cp={r['cp']} {r['layout']:>10}: visible pairs {r['visible_max_over_mean']:.2f} "
            f"(worst {r['visible_max_over_mean_worst']:.2f}), computed "
            f"{r['computed_max_over_mean']:.2f}, ring critical path "
            f"{r['ring_critical_path_over_mean']:.2f}; mask removes "
            f"{100 * r['mask_removes_of_causal_pairs']:.0f}% of causal pairs, ring skips "
            f"{100 * r['kernel_work_skipped']:.0f}% of its kernel work"
        )


def window_work_report(seq: int, window: int, cps=(2, 4, 8)) -> list[dict]:
    """Per cp (zigzag): the pairs a sliding window of `window` keys leaves visible and the
    pairs the ring's kernel calls compute (chunk pairs wholly outside the window are not
    called), against the unmasked causal ring's kernel work; and the per-rank balance."""
    rows = []
    for cp in cps:
        one_document = torch.zeros(1, seq, dtype=torch.int64)
        seen, done = document_attention_work(one_document, cp, True, True, window)
        seen_rank, done_rank = [sum(r) for r in seen], [sum(r) for r in done]
        rect = sum(map(sum, _ring_rectangles(cp, seq, True)))
        rows.append(
            {
                "cp": cp,
                "visible_pairs": sum(seen_rank),
                "computed_pairs": sum(done_rank),
                "causal_ring_computed_pairs": rect,
                "computed_over_causal_ring": sum(done_rank) / rect,
                "computed_max_over_mean": _balance(done_rank),
            }
        )
    return rows


def window_only(args) -> None:
    rows = window_work_report(args.seq, args.window)
    print(json.dumps({"seq": args.seq, "window": args.window, "rows": rows}))
    print(f"sliding window of {args.window} keys, seq {args.seq}, zigzag:")
    for r in rows:
        print(
            f"  cp={r['cp']}: the ring computes {r['computed_pairs']:,} pairs = "
            f"{100 * r['computed_over_causal_ring']:.1f}% of the causal ring's "
            f"{r['causal_ring_computed_pairs']:,} (visible {r['visible_pairs']:,}); per-rank "
            f"max/mean {r['computed_max_over_mean']:.2f}"
        )


def _timed(fn, iters: int, device: torch.device) -> float:
    times = []
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def docs_timed(args, rank: int, cp: int, device, local, zigzag: bool) -> None:
    """The ring with and without document masks on the same q/k/v (math kernel for both:
    the one that takes a mask); rank 0 prints times (slowest rank) and computed pairs."""
    ids = lognormal_document_ids(args.seq, args.batch, args.seq / 4, args.doc_sigma)
    local_ids = split_for_cp(ids, rank, cp, zigzag).to(device)
    mine = {}
    for name, doc in (("unmasked", None), ("masked", local_ids)):
        stats = RingStats()

        def step(doc=doc, stats=stats):
            out, _ = ring_attention(
                *local, scale=args.head_dim**-0.5, causal=True, zigzag=zigzag, kernel="math",
                group=dist.group.WORLD, stats=stats, document_ids=doc,
            )  # fmt: skip
            out.float().square().mean().backward()

        seconds = _timed(step, args.iters, device)
        calls = args.iters + 1
        mine[name] = (seconds, stats.pairs // calls, stats.kernel_calls // calls)
    every = [None] * cp
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    result = {"cp": cp, "device": str(device), **vars(args), "mean_doc_len": args.seq / 4}
    for name in ("unmasked", "masked"):
        result[name] = {
            "fwd_bwd_s": max(r[name][0] for r in every),  # the ring waits for the slowest
            "pairs_per_rank": [r[name][1] for r in every],
            "kernel_calls_per_rank": [r[name][2] for r in every],
        }
    pairs = {n: sum(result[n]["pairs_per_rank"]) for n in ("unmasked", "masked")}
    result["work_skipped"] = 1 - pairs["masked"] / pairs["unmasked"]
    result["masked_pairs_max_over_mean"] = _balance(result["masked"]["pairs_per_rank"])
    result["time_masked_over_unmasked"] = (
        result["masked"]["fwd_bwd_s"] / result["unmasked"]["fwd_bwd_s"]
    )
    print(json.dumps(result))
    print(
        f"ring cp={cp} ({args.layout}, math) seq {args.seq}, lognormal documents (mean "
        f"{args.seq // 4}): {1000 * result['unmasked']['fwd_bwd_s']:.1f} ms without the "
        f"mask, {1000 * result['masked']['fwd_bwd_s']:.1f} ms with it; the mask skips "
        f"{100 * result['work_skipped']:.0f}% of the computed pairs (per-rank max/mean "
        f"{result['masked_pairs_max_over_mean']:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--docs", action="store_true", help="time with and without masks")
    parser.add_argument("--docs-only", action="store_true", help="work counts, no processes")
    parser.add_argument("--doc-sigma", type=float, default=1.0, help="lognormal sigma")
    parser.add_argument("--samples", type=int, default=32, help="--docs-only: samples")
    parser.add_argument("--window", type=int, default=128, help="--window-only: keys")
    parser.add_argument(
        "--window-only", action="store_true", help="sliding-window work counts, no processes"
    )
    args = parser.parse_args()
    if args.docs_only:
        return docs_only(args)
    if args.window_only:
        return window_only(args)

    if "RANK" in os.environ:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator(device).manual_seed(0)
    shape = (args.batch, args.seq)
    q = torch.randn(*shape, args.heads, args.head_dim, device=device, generator=g)
    k, v = (
        torch.randn(*shape, args.kv_heads, args.head_dim, device=device, generator=g)
        for _ in range(2)
    )
    zigzag = args.layout == "zigzag"
    local = [split_for_cp(t, rank, cp, zigzag).requires_grad_() for t in (q, k, v)]
    if args.docs:
        docs_timed(args, rank, cp, device, local, zigzag)
        dist.barrier()
        dist.destroy_process_group()
        return
    stats = RingStats()

    def ring_step():
        out, _ = ring_attention(
            *local, scale=args.head_dim**-0.5, causal=True, zigzag=zigzag,
            kernel=args.kernel, group=dist.group.WORLD, stats=stats,
        )  # fmt: skip
        out.float().square().mean().backward()

    ring_s = _timed(ring_step, args.iters, device)
    dist.barrier()
    result = {"cp": cp, "device": str(device), **vars(args), "ring_fwd_bwd_s": ring_s}
    if rank == 0:
        full = [t.clone().requires_grad_() for t in (q, k, v)]

        def full_step():
            out = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in full), is_causal=True, enable_gqa=True
            )
            out.float().square().mean().backward()

        result["full_sdpa_fwd_bwd_s"] = _timed(full_step, args.iters, device)
        result["speedup_vs_one_device"] = result["full_sdpa_fwd_bwd_s"] / ring_s
    result["p2p_ops_per_step"] = stats.p2p_ops // (args.iters + 1)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result))
        print(
            f"ring attention cp={cp} ({args.layout}, {args.kernel}) seq {args.seq}: "
            f"{1000 * ring_s:.1f} ms fwd+bwd vs {1000 * result['full_sdpa_fwd_bwd_s']:.1f} ms "
            f"full-sequence SDPA on one device ({result['speedup_vs_one_device']:.2f}x), "
            f"{result['p2p_ops_per_step']} p2p ops per step"
        )


if __name__ == "__main__":
    main()
