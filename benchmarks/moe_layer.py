"""One MoE layer, forward + backward: grouped GEMM vs per-expert loop, and dispatch cost.

    python benchmarks/moe_layer.py [--tokens=4096 --hidden=512 --inter=256 --experts=16
                                    --topk=4 --iters=10 --dtype=fp32|bf16]
    torchrun --nproc_per_node=N benchmarks/moe_layer.py ...   (adds expert parallelism over N
                                                               ranks: all-to-all cost and bytes)

Prints one JSON object (rank 0), then a one-line summary.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter  # noqa: E402
from moetrain.parallelisms.expert_parallel import apply_expert_parallel  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(layer: MoE, x: torch.Tensor, iters: int) -> float:
    times = []
    for i in range(iters + 2):  # two warm-up calls
        _sync(x.device)
        start = time.perf_counter()
        y, _ = layer(x)
        y.float().square().mean().backward()
        _sync(x.device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(args, gemm: str, device: torch.device, dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    with device:  # built where it runs: the full shapes are slow to fill on the host
        layer = MoE(
            args.hidden,
            args.inter,
            TopKRouter(args.hidden, args.experts, args.topk, True),
            MoEOptions(gemm=gemm),
        )
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return layer.to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("tokens", 4096), ("hidden", 512), ("inter", 256), ("experts", 16)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    result = {"device": str(device), "dtype": args.dtype, **vars(args)}

    for gemm in ("grouped_mm", "loop"):
        try:
            result[f"{gemm}_fwd_bwd_s"] = time_fwd_bwd(
                build(args, gemm, device, dtype), x, args.iters
            )
        except RuntimeError as err:  # e.g. grouped_mm unsupported for this dtype/device
            result[f"{gemm}_fwd_bwd_s"] = None
            result[f"{gemm}_error"] = str(err).splitlines()[0]
    if result["grouped_mm_fwd_bwd_s"] and result["loop_fwd_bwd_s"]:
        result["grouped_mm_speedup"] = result["loop_fwd_bwd_s"] / result["grouped_mm_fwd_bwd_s"]

    if distributed:
        world = dist.get_world_size()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        layer = build(args, "auto", device, dtype)
        dispatcher = apply_expert_parallel(
            (layer.permute, layer.experts, layer.unpermute), mesh, ranks_per_node=world
        )
        result["ep"] = world
        result["ep_fwd_bwd_s"] = time_fwd_bwd(layer, x, args.iters)
        dispatcher.reset_traffic()
        y, _ = layer(x)
        result["a2a_bytes_forward"] = dispatcher.reset_traffic().sent
        assignments = args.tokens * args.topk
        expert = torch.randint(0, args.experts, (assignments,), device=device)
        tokens_per_expert = torch.bincount(expert, minlength=args.experts)
        xs = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
        token_of = torch.argsort(expert, stable=True) // args.topk  # expert-major
        weights = torch.rand(assignments, device=device)
        times = []
        for _ in range(args.iters):
            _sync(device)
            start = time.perf_counter()
            sent = dispatcher.send(xs, tokens_per_expert, token_of, weights, wait=True)
            x_local = dispatcher.arrive(sent)[0]
            dispatcher.landed(dispatcher.combine(x_local, wait=True), token_of, args.tokens)
            _sync(device)
            times.append(time.perf_counter() - start)
        result["dispatch_combine_s"] = statistics.median(times)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return

    print(json.dumps(result))
    summary = f"MoE layer {args.tokens} tok x top-{args.topk} of {args.experts} experts ({args.dtype}, {device.type}): "
    parts = [
        f"{g} {1000 * result[f'{g}_fwd_bwd_s']:.1f} ms"
        for g in ("grouped_mm", "loop")
        if result[f"{g}_fwd_bwd_s"]
    ]
    summary += ", ".join(parts)
    if "grouped_mm_speedup" in result:
        summary += f" (grouped {result['grouped_mm_speedup']:.2f}x)"
    if "ep" in result:
        summary += f"; EP{result['ep']} {1000 * result['ep_fwd_bwd_s']:.1f} ms, dispatch+combine {1000 * result['dispatch_combine_s']:.1f} ms, {result['a2a_bytes_forward'] / 2**20:.2f} MiB sent fwd"
    print(summary)


if __name__ == "__main__":
    main()
