"""One MoE layer with a shared expert under expert parallelism: forward + backward with the
combine in flight under the shared expert (`parallel.ep_overlap=shared`), with the tokens
also split in two chunks whose all-to-alls run under each other's experts (`chunks`), and
with every transfer waited for at once (`none`), measured alternately in one run.

    torchrun --nproc_per_node=2 benchmarks/ep_overlap.py [--tokens=4096 --hidden=1024
        --inter=256 --shared=1024 --experts=8 --topk=2 --iters=10 --out=FILE.json]

The default rows are wide so that the all-to-all costs about what the experts do. Prints one
JSON object (rank 0; also written to --out), then a one-line summary. A measurement, not a
claim: on a 2-core CPU the gloo threads and the compute share the same cores.
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
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.models.common.moe import MoE, MoEOptions, TopKRouter  # noqa: E402
from moetrain.parallelisms.expert_parallel import apply_expert_parallel  # noqa: E402

MODES = ("shared", "chunks", "none")


def build(args, mesh, overlap: str) -> tuple[MoE, object]:
    torch.manual_seed(0)  # the same weights for every mode
    layer = MoE(
        args.hidden,
        args.inter,
        TopKRouter(args.hidden, args.experts, args.topk, True),
        MoEOptions(chunks=2 if overlap == "chunks" else 1),
        shared_hidden_dim=args.shared,
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    world = mesh.size()
    dispatcher = apply_expert_parallel(
        (layer.permute, layer.experts, layer.unpermute), mesh, ranks_per_node=world, overlap=overlap
    )
    return layer, dispatcher


def fwd_bwd(layer: MoE, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    y, _ = layer(x)
    y.square().mean().backward()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("tokens", 4096), ("hidden", 1024), ("inter", 256), ("shared", 1024)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("run it under torchrun (e.g. --nproc_per_node=2): it measures expert parallelism")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(1, args.tokens, args.hidden)
    layers = {mode: build(args, mesh, mode) for mode in MODES}
    times = {mode: [] for mode in MODES}
    for i in range(args.iters + 2):  # two warm-up rounds
        for mode in MODES:  # alternately, so that drifts of the machine hit both
            seconds = fwd_bwd(layers[mode][0], x)
            if i >= 2:
                times[mode].append(seconds)
    sent = {}
    for mode, (layer, dispatcher) in layers.items():
        dispatcher.reset_traffic()
        layer(x)[0].sum().backward()
        sent[mode] = dispatcher.reset_traffic().sent
    with torch.no_grad():  # shared: the same output, bit for bit (only the wait moved)
        y = {mode: layers[mode][0](x)[0] for mode in MODES}
        same = torch.equal(y["shared"], y["none"])
        chunks_err = ((y["chunks"] - y["none"]).abs().max() / y["none"].abs().max()).item()
    dist.destroy_process_group()
    if int(os.environ["RANK"]) != 0:
        return
    med = {mode: statistics.median(t) for mode, t in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu (gloo)",
        "command": f"torchrun --nproc_per_node={world} benchmarks/ep_overlap.py "
        + " ".join(sys.argv[1:]),
        "ep": world,
        **{k: v for k, v in vars(args).items() if k != "out"},
        "fwd_bwd_s": med,
        "none_over_shared": med["none"] / med["shared"],
        "none_over_chunks": med["none"] / med["chunks"],
        "a2a_bytes_per_step": sent,
        "outputs_bit_equal": same,  # shared against none
        "chunks_max_rel_err": chunks_err,  # chunks against none (expert GEMMs of other sizes)
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"EP{world} MoE layer, {args.tokens} tok x top-{args.topk} of {args.experts}, shared "
        f"{args.shared}: waited at once {1000 * med['none']:.1f} ms; shared "
        f"{1000 * med['shared']:.1f} ms (x{result['none_over_shared']:.2f}, outputs equal: "
        f"{same}); chunks {1000 * med['chunks']:.1f} ms (x{result['none_over_chunks']:.2f}, "
        f"rel. err {chunks_err:.1e})"
    )


if __name__ == "__main__":
    main()
