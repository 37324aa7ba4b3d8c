"""Our Qwen3-30B-A3B proxy vs torchtitan's Qwen3 MoE: one device, same shapes, same batches.

    python benchmarks/vs_torchtitan.py [--layers=4 --seq=4096 --warmup=3 --steps=10
                                        --compile --device=cuda|cpu --tiny --json=PATH]

Both sides train alike: FSDP2 on a 1-rank mesh (bf16 compute, fp32 reduce; fp32 on CPU),
AdamW, clipping at norm 1, micro-batch 1, the same random tokens; `warmup` untimed steps,
then `steps` timed. Needs torchtitan 0.2.2 importable (`import_torchtitan_qwen3`). Prints
one JSON object (benchmarks/report.py), then a one-line summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_result  # noqa: E402
from models import get_model_spec  # noqa: E402
from models.common.balance_losses import load_balancing_loss  # noqa: E402
from parallelisms.clip import clip_grads_, grad_norm  # noqa: E402
from parallelisms.dims import ParallelDims  # noqa: E402
from parallelisms.init import init_weights_global  # noqa: E402
from parallelisms.mesh import build_meshes  # noqa: E402
from parallelisms.plan import match_modules  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop.losses import token_loss_sum  # noqa: E402
from trainer.loop.optim import build_optimizer  # noqa: E402
from trainer.loop.setup import build_model, init_distributed  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "qwen3_30b_a3b.toml")
# Our [model] keys -> values; full = configs/qwen3_30b_a3b.toml's, restated for both sides.
FULL = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
TINY = dict(FULL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            vocab_size=1024)  # fmt: skip
# torchtitan's Qwen3ModelArgs field -> our key; its MoEArgs fields are set separately.
TITAN_NAMES = dict(n_layers="num_hidden_layers", dim="hidden_size", head_dim="head_dim",
                   n_heads="num_attention_heads", n_kv_heads="num_key_value_heads",
                   moe_inter_dim="moe_intermediate_size", vocab_size="vocab_size",
                   rope_theta="rope_theta", norm_eps="rms_norm_eps")  # fmt: skip
MAX_GRAD_NORM, LR = 1.0, 1e-5  # LR: our config's, constant on both sides

# Where the two sides still differ (each trainer's own defaults), for the JSON.
DIFFERENCES = [
    "balancing: ours adds Qwen3's Switch aux loss (1e-3); torchtitan moves an expert bias "
    "(aux-loss-free, 1e-3) before each update instead",
    "router: both softmax (fp32), top-k, renormalised; ours keeps its weight fp32, titan bf16",
    "experts: both torch._grouped_mm in bf16; torchtitan pads each expert's rows to 8",
    "FSDP units: ours routers, blocks, root; titan embeddings, blocks, [norm, output], root",
    "torchtitan's own trainer would autocast fp32 parameters on one GPU instead of FSDP",
    "AdamW foreach on both (torchtitan's default: fused); ours spares 1-D params weight decay",
    "compile: ours each block's forward; torchtitan each block's submodules and its grouped "
    "GEMM, not its token dispatch; the loss on neither side",
    "torchtitan flavor 30B-A3B overridden: n_layers, max_seq_len = seq (as its trainer does)",
    "weights: each side's own random init; on random tokens both route near-uniformly",
]


def shapes_of(args) -> dict:  # our [model] keys of this run; batches are 1 x args.seq
    return dict(TINY if args.tiny else FULL, num_hidden_layers=args.layers)


def build_ours(args, shapes: dict, device):
    """Our trainer's own path: config -> build_model (plan, bf16 FSDP, compile) -> init."""
    cfg = load_config(
        ["--config", CONFIG, f"--data.seq_len={args.seq}", f"--train.device={device.type}",
         f"--train.compile={str(args.compile).lower()}", f"--train.lr={LR}",
         f"--train.max_grad_norm={MAX_GRAD_NORM}"]
        + [f"--model.{k}={v}" for k, v in shapes.items()]
    )  # fmt: skip
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):  # counted unsharded, before the plan wraps anything
        ref = spec.build(cfg.model.args)
    experts = match_modules(ref, spec.plan.routed_experts, "routed_experts")
    counts = sum(p.numel() for p in ref.parameters()), sum(
        p.numel() for _, m in experts for p in m.parameters())  # fmt: skip
    meshes = build_meshes(ParallelDims.of(cfg.parallel, 1), device.type)
    model, _ = build_model(cfg, spec, meshes, device)
    init_weights_global(model, cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train)
    params = [p for p in model.parameters() if p.requires_grad]
    aux_coef = spec.loss_terms(cfg.model.args).aux_loss_coef

    def step(inputs, labels):
        out = model(inputs)
        loss = token_loss_sum(out.logits, labels) / labels.numel()
        if out.router_stats is not None and aux_coef:
            loss = loss + aux_coef * load_balancing_loss(out.router_stats, shapes["num_experts"])
        loss.backward()
        clip_grads_(params, MAX_GRAD_NORM, grad_norm(params))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, counts, {"config": os.path.relpath(CONFIG, ROOT)}


def import_torchtitan_qwen3():
    """torchtitan.models.qwen3 without the `datasets` package: its __init__ imports the HF data
    loader, hence `datasets` and pyarrow (tens of MiB, too heavy to carry offline). No data set
    is loaded here, so a placeholder that raises if called stands in where it is missing."""
    try:
        import datasets  # noqa: F401
    except ImportError:

        def missing(*_args, **_kwargs):
            raise RuntimeError("the datasets package is not installed (vs_torchtitan.py)")

        stub, stub_dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset = type("Dataset", (), {}), missing
        stub.distributed, stub_dist.split_dataset_by_node = stub_dist, missing
        sys.modules.update({"datasets": stub, "datasets.distributed": stub_dist})
    import torchtitan.models.qwen3 as qwen3

    return qwen3


def build_torchtitan(args, shapes: dict, device):
    """torchtitan's model, FSDP wrapping, compile, optimizer (with its balancing hook), loss
    and clipping, used as a library; only the shapes are ours."""
    qwen3 = import_torchtitan_qwen3()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.config.job_config import Compile, Optimizer
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp

    margs = copy.deepcopy(qwen3.qwen3_args["30B-A3B"])
    for theirs, ours in TITAN_NAMES.items():
        setattr(margs, theirs, shapes[ours])
    margs.max_seq_len = args.seq  # the flavor's 262144 would only grow the RoPE cache
    moe = margs.moe_args
    moe.num_experts, moe.top_k = shapes["num_experts"], shapes["num_experts_per_tok"]
    moe.use_grouped_mm = device.type == "cuda"  # its row-padding kernel is Triton (GPU) only
    assert margs.moe_enabled and margs.qk_norm and not margs.enable_weight_tying  # as Qwen3
    assert (moe.score_func, moe.route_norm, moe.route_scale, moe.num_shared_experts) == (
        "softmax", True, 1.0, 0) and not moe.score_before_experts  # fmt: skip
    assert (margs.attn_type, margs.attn_mask_type) == ("sdpa", "causal")

    with torch.device("meta"):
        model = qwen3.Qwen3Model(margs)
    counts = sum(p.numel() for p in model.parameters()), sum(
        p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)  # fmt: skip
    if args.compile:  # before FSDP, in the order of torchtitan's parallelize_qwen3
        apply_compile(model, Compile(enable=True, components=["model"]), ep_enabled=False)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    optim_cfg = Optimizer(lr=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                          implementation="foreach")  # fmt: skip
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers_with_moe_load_balancing([model], optim_cfg, dims)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(inputs, labels):
        loss = cross_entropy_loss(model(inputs), labels) / labels.numel()
        loss.backward()
        clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
        optimizers.step()
        optimizers.zero_grad()
        return loss.detach()

    flavor = {k: v for k, v in vars(margs).items() if not k.startswith("_") and k != "moe_args"}
    flavor["moe_args"] = {k: v for k, v in vars(moe).items() if not k.startswith("_")}
    info = {"torchtitan_version": sys.modules["torchtitan"].__version__, "model_args": flavor}
    return step, counts, info


def run_side(args) -> dict:
    """One side in this process: build, train warmup + steps, measure."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    cuda = device.type == "cuda"
    init_distributed(device)  # a world of one: nccl on CUDA, gloo on CPU
    torch.manual_seed(0)
    shapes = shapes_of(args)
    build = build_ours if args.side == "ours" else build_torchtitan
    step, (total, experts), info = build(args, shapes, device)
    k, e = shapes["num_experts_per_tok"], shapes["num_experts"]
    result = {
        "params_total": total,
        "params_activated_per_token": round(total - experts * (1 - k / e)),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        **info,
    }
    sync = torch.cuda.synchronize if cuda else lambda: None
    gen = torch.Generator().manual_seed(1234)  # the same random tokens on both sides
    tokens = torch.randint(0, shapes["vocab_size"], (args.warmup + args.steps, 1, args.seq + 1),
                           generator=gen).to(device)  # fmt: skip
    times, losses = [], []
    try:
        for i, t in enumerate(tokens):
            sync()
            start = time.perf_counter()
            losses.append(step(t[:, :-1], t[:, 1:]))
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    except NotImplementedError as err:  # an op without a CPU kernel: report what was built
        if cuda:
            raise
        result["not_trained"] = f"built and counted only: {err}"
    else:
        step_time = statistics.median(times)
        result.update(
            tokens_per_s=args.seq / step_time,  # micro-batch 1
            step_time_s=step_time,
            step_times_s=times,
            peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            loss_first=losses[0].item(),
            loss_last=losses[-1].item(),
        )
    dist.destroy_process_group()
    return result


def said(name: str, side: dict) -> str:
    if "error" in side:
        return f"{name} failed ({side['error'].splitlines()[-1]})"
    if "tokens_per_s" not in side:
        return f"{name} built ({side['params_total']:,} params) but not trained on this device"
    mem = f", {side['peak_mem_gib']:.1f} GiB" if side["peak_mem_gib"] is not None else ""
    return f"{name} {side['tokens_per_s']:,.0f} tok/s, {1000 * side['step_time_s']:.0f} ms{mem}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="default 4 (2 with --tiny)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --tiny)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="torch.compile per block, both")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths for a CPU check")
    parser.add_argument("--json", default=None, help="write the JSON here (default: stdout)")
    parser.add_argument("--side", choices=("ours", "torchtitan"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layers = args.layers or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 4096)
    if args.side:  # a child: one side, its JSON to the parent's file
        write_result(run_side(args), args.json)
        return

    result = {"benchmark": "vs_torchtitan", "device": args.device, "compile": args.compile,
              "warmup": args.warmup, "steps": args.steps, "seq_len": args.seq,
              "micro_batch_size": 1, "shapes": shapes_of(args)}  # fmt: skip
    # NOTE: a process per side, in turn (so not interleaved): a 4-layer side fills most of an
    # H100, peak memory is per process, and torchtitan's compile sets dynamo flags globally.
    for side in ("ours", "torchtitan"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "side.json")  # the child's: the last --json wins
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], f"--side={side}"]
            proc = subprocess.run([*cmd, f"--json={out}"], capture_output=True, text=True)
            if proc.returncode:  # keep the other side's numbers; say why this one has none
                result[side] = {"error": (proc.stderr or proc.stdout).strip()[-3000:]}
                continue
            with open(out) as f:
                result[side] = json.load(f)
    ours, theirs = result["ours"], result["torchtitan"]
    if "tokens_per_s" in ours and "tokens_per_s" in theirs:
        mem = ours["peak_mem_gib"], theirs["peak_mem_gib"]
        result["ours_over_torchtitan"] = {
            "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "peak_mem": mem[0] / mem[1] if None not in mem else None,
        }
    result["differences"] = DIFFERENCES
    write_result(result, args.json)
    how = f"{args.device}{', compiled' if args.compile else ''}{', tiny' if args.tiny else ''}"
    summary = f"vs torchtitan, {args.layers} layers x seq {args.seq} ({how}): "
    summary += f"{said('ours', ours)}; {said('torchtitan', theirs)}"
    if "ours_over_torchtitan" in result:
        summary += f"; ours/torchtitan {result['ours_over_torchtitan']['tokens_per_s']:.2f}x tok/s"
    print(summary)


if __name__ == "__main__":
    main()
