"""Ring attention over cp ranks vs one-device attention on the full sequence (fwd + bwd).

    torchrun --nproc_per_node=CP benchmarks/ring_attention.py [--seq=4096 --heads=8
        --kv-heads=2 --head-dim=64 --batch=1 --iters=5 --kernel=auto --layout=zigzag]

Prints one JSON object (rank 0), then a one-line summary. The reference is PyTorch SDPA
on the whole sequence in one process (timed on rank 0 after the ring, alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallelisms.context_parallel import RingStats, ring_attention  # noqa: E402
from parallelisms.cp_schedule import split_for_cp  # noqa: E402


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
    args = parser.parse_args()

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
