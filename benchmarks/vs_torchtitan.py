"""Our Qwen3-30B-A3B proxy vs torchtitan's Qwen3 MoE: one device, same shapes, same batches.

    python benchmarks/vs_torchtitan.py [--layers=4 --seq=4096 --warmup=3 --steps=10 --accum=1
                                        --profile-steps=3 --compile --device=cuda|cpu --tiny
                                        --json=PATH]

Ours is the real trainer: a `Trainer` built from configs/qwen3_30b_a3b.toml as train.py
builds it (the proxy's shapes, seq, micro-batch 1, `accum` micro-batches a step, bf16 on
CUDA, fp32 on CPU), stepped as train.py steps it: `Trainer.advance` (the step queued: loss,
guard, clip, update; the previous step's record read and logged; the SIGTERM check). torchtitan is 0.2.2 at its
own defaults (fused AdamW; compile of model and loss) through its own builders
(benchmarks/titan_side.py). Both: FSDP2 on a 1-rank mesh, clipping at norm 1, the same
random tokens; `warmup` untimed steps, `steps` timed together (synchronised before and after
the window, not between steps), then `profile-steps` under torch.profiler for the GPU busy
fraction and, compiled, whether Triton kernels ran. Prints one JSON object
(benchmarks/report.py), then a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_result  # noqa: E402
from moetrain.build.distributed import init_distributed  # noqa: E402
from moetrain.config import load_config  # noqa: E402
from moetrain.data.batch import Batch  # noqa: E402
from moetrain.loop.preflight import preflight  # noqa: E402
from moetrain.loop.trainer import Trainer  # noqa: E402
from moetrain.parallelisms.dims import ParallelDims  # noqa: E402
from moetrain.parallelisms.plan import match_modules  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "qwen3_30b_a3b.toml")
# Our [model] keys -> values; full = configs/qwen3_30b_a3b.toml's, restated for both sides.
FULL = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
TINY = dict(FULL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            vocab_size=1024)  # fmt: skip
TOP_KERNELS = 40  # the kernels (and ops) listed per side, by their time in a profiled step
MAX_GRAD_NORM, LR = 1.0, 1e-5  # LR: our config's peak, on both sides

# Where the two sides still differ (each trainer's own defaults), for the JSON.
DIFFERENCES = [
    "step: ours Trainer.train_step + Trainer.end_step, as train.py; torchtitan's "
    "Trainer.train_step restated (its Trainer needs a tokenizer and data on disk), reading "
    "loss and norm on the host at its log_freq (10) where ours reads them every step",
    "data: building each step's batches (the loaders' work) is outside the timed window on "
    "both sides; the host-to-device copy (ours trainer.batches.prepare_batch) is inside",
    "balancing: ours adds Qwen3's Switch aux loss (1e-3); torchtitan moves an expert bias "
    "(aux-loss-free, 1e-3) before each update instead",
    "router: both softmax (fp32), top-k, renormalised; ours keeps its weight fp32, titan bf16",
    "experts: both torch._grouped_mm in bf16; torchtitan pads each expert's rows to 8",
    "FSDP units: ours routers, blocks, root; titan embeddings, blocks, [norm, output], root",
    "torchtitan's own trainer would autocast fp32 parameters on one GPU instead of FSDP",
    "FSDP on one rank: ours casts and copies each unit once per step (parallel.fsdp_gather="
    "auto) and sets no gradient divide factor there; torchtitan reshards blocks after "
    "forward (recast in backward) and its divide factor costs a pass over the gradients",
    "clipping: ours hands the clip scale to fused AdamW (its grad_scale); torchtitan "
    "scales the gradients in a pass of their own before the update",
    "AdamW: torchtitan fused (its default), ours as optimizer_impl says; ours spares 1-D "
    "params weight decay",
    "lr: ours the config's warmup and cosine from 1e-5 (set_lr, part of its step); "
    "torchtitan a constant 1e-5 (its scheduler not stepped)",
    "compile: ours each block's forward; torchtitan (its default components: model, loss) "
    "each block's submodules and its grouped GEMM, not its token dispatch, and its loss",
    "torchtitan flavor 30B-A3B overridden: n_layers, max_seq_len = seq (as its trainer does)",
    "weights: each side's own random init; on random tokens both route near-uniformly",
]


def shapes_of(args) -> dict:  # our [model] keys of this run; micro-batches are 1 x args.seq
    return dict(TINY if args.tiny else FULL, num_hidden_layers=args.layers)


def optimizer_impl(optimizer) -> str:
    """fused | foreach | for-loop, as the optimizer's param groups say (torchtitan's container
    holds one optimizer per model part)."""
    groups = [g for o in getattr(optimizer, "optimizers", [optimizer]) for g in o.param_groups]
    for impl in ("fused", "foreach"):
        if all(g.get(impl) for g in groups):
            return impl
    return "for-loop" if all(g.get("foreach") is False for g in groups) else "torch default"


def build_ours(args, shapes: dict, device: torch.device, out_dir: str):
    """Our Trainer as train.py builds it. Returns (load, step, counts, optimizer, info):
    `load` turns [accum, 1, seq + 1] host tokens into the loader's micro-batches (untimed),
    `step` runs one step on them as train.py's loop does and returns its loss."""
    total = args.warmup + args.steps + args.profile_steps
    cuda = device.type == "cuda"
    cfg = load_config(
        ["--config", CONFIG, f"--data.seq_len={args.seq}", f"--train.device={device.type}",
         f"--train.mixed_precision={'bf16' if cuda else 'fp32'}",
         f"--train.compile={str(args.compile).lower()}", f"--train.lr={LR}",
         f"--train.max_grad_norm={MAX_GRAD_NORM}", "--train.micro_batch_size=1",
         f"--train.global_batch_size={args.accum}", f"--train.steps={total}",
         f"--job.output_dir={out_dir}", "--metrics.progress=false",
         "--checkpoint.interval=0", "--eval.interval=0",
         # its loader is built but not read (the batches are the shared random tokens)
         f"--data.max_tokens={4 * args.accum * (args.seq + 1)}"]
        + [f"--model.{k}={v}" for k, v in shapes.items()]
        + list(getattr(args, "overrides", []))  # benchmarks/op_counts.py's --moe.gemm
    )  # fmt: skip
    dims = ParallelDims.of(cfg.parallel, 1)
    trainer = Trainer(cfg, dims, preflight(cfg, dims))
    with torch.device("meta"):  # counted unsharded, before the plan wraps anything
        ref = trainer.spec.build(trainer.args)
    experts = match_modules(ref, trainer.spec.plan.routed_experts, "routed_experts")
    counts = sum(p.numel() for p in ref.parameters()), sum(
        p.numel() for _, m in experts for p in m.parameters())  # fmt: skip
    positions = torch.arange(args.seq).unsqueeze(0)

    def load(tokens: torch.Tensor) -> list[Batch]:
        return [
            Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), positions,
                  torch.zeros_like(positions))
            for t in tokens
        ]  # fmt: skip

    def step(micro_batches: list[Batch]) -> None:
        # As train.py's loop: the step queued, the previous one's record read (its loss is in
        # trainer.history once read: `losses_of`).
        trainer.advance([trainer.batches.prepare_batch(b) for b in micro_batches])

    info = {
        "config": os.path.relpath(CONFIG, ROOT),
        "optimizer_impl_setting": getattr(cfg.train, "optimizer_impl", None),
        "flops_per_token": trainer.flops_per_token,
        "peak_flops": trainer.peak_flops,
        "step": "Trainer.advance (moetrain/loop/trainer.py): the loop body of train.py",
        "losses_of": lambda: [r["loss"] for r in trainer.history],  # popped by `measure`
    }
    return load, step, counts, trainer.optimizer, info


def profiled(run, cuda: bool, steps: int = 1) -> dict:
    """`run()` (`steps` steps) under torch.profiler: on CUDA the kernels' summed time over
    the window's wall time (streams that overlap count twice), the Triton kernels among them
    (inductor's: compile took effect) and the kernels that take the most time, in ms a step
    (where the two sides' GPU work differs); nothing of these on CPU."""
    sync = torch.cuda.synchronize if cuda else lambda: None
    sync()
    # NOTE: CPU activity too on CUDA, so each kernel's time is also charged to the aten op
    # that launched it (cutlass kernel names do not say which GEMM they are).
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - start
    # NOTE: with CPU activity, record_function ranges (FSDP's, the optimizer's) also appear
    # on the GPU timeline as annotations spanning their kernels: not kernels themselves.
    kernels = [
        e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]
    busy_s = sum(e.device_time_total for e in kernels) / 1e6
    triton = {e.name for e in kernels if "triton" in e.name.lower()}
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    ops = [
        (a.key, a.self_device_time_total / 1e3 / steps, a.count // steps)
        for a in prof.key_averages()
        if a.device_type == DeviceType.CPU and not a.is_user_annotation
    ]
    top_ops = sorted((o for o in ops if o[1] > 0), key=lambda o: -o[1])[:TOP_KERNELS]
    return {
        "top_kernels_ms_per_step": [[name[:160], round(ms, 3)] for name, ms in top],
        # [op, its kernels' ms a step, calls a step]
        "top_ops_ms_per_step": [[k[:80], round(ms, 3), n] for k, ms, n in top_ops]
        if cuda
        else None,
        "profiled_wall_s": wall,
        "gpu_kernel_s": busy_s if cuda else None,
        "gpu_busy": busy_s / wall if cuda else None,
        "triton_kernel_names": len(triton) if cuda else None,
    }


def run_side(args) -> dict:
    """One side in this process: build, train warmup + steps (timed) + profiled steps."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    init_distributed(device)  # a world of one: nccl on CUDA, gloo on CPU
    torch.manual_seed(0)
    shapes = shapes_of(args)
    with tempfile.TemporaryDirectory() as out_dir:
        if args.side == "ours":
            built = build_ours(args, shapes, device, out_dir)
        else:
            from benchmarks.titan_side import build_torchtitan

            built = build_torchtitan(args, shapes, device, LR, MAX_GRAD_NORM)
        result = measure(args, shapes, device, *built)
    dist.destroy_process_group()
    return result


def measure(args, shapes, device, load, step, counts, optimizer, info) -> dict:
    cuda = device.type == "cuda"
    losses_of = info.pop("losses_of", None)  # ours: its losses, from its records once read
    total, experts = counts
    k, e = shapes["num_experts_per_tok"], shapes["num_experts"]
    result = {
        "params_total": total,
        "params_activated_per_token": round(total - experts * (1 - k / e)),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "optimizer_impl": optimizer_impl(optimizer),
        **info,
    }
    sync = torch.cuda.synchronize if cuda else lambda: None
    gen = torch.Generator().manual_seed(1234)  # the same random tokens on both sides
    steps = args.warmup + args.steps + args.profile_steps
    tokens = torch.randint(0, shapes["vocab_size"], (steps, args.accum, 1, args.seq + 1),
                           generator=gen)  # fmt: skip
    batches = [load(t) for t in tokens]  # the loader's work: not timed
    losses = []
    timed = range(args.warmup, args.warmup + args.steps)
    try:
        for i in range(args.warmup):
            losses.append(step(batches[i]))
        sync()
        marks = [time.perf_counter()]
        for i in timed:  # no sync between steps: the host runs ahead as in train.py
            losses.append(step(batches[i]))
            marks.append(time.perf_counter())
        sync()
        wall = time.perf_counter() - marks[0]
        rest = range(timed.stop, steps)
        prof = profiled(lambda: losses.extend(step(batches[i]) for i in rest), cuda, len(rest))
    except NotImplementedError as err:  # an op without a CPU kernel: report what was built
        if cuda:
            raise
        result["not_trained"] = f"built and counted only: {err}"
        return result
    losses = losses_of() if losses_of is not None else losses
    step_time = wall / args.steps
    result.update(
        tokens_per_s=args.accum * args.seq / step_time,
        step_time_s=step_time,
        step_host_times_s=[b - a for a, b in zip(marks, marks[1:])],
        peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        loss_first=float(losses[0]),
        loss_last=float(losses[-1]),
        **prof,
        compile_took_effect=(prof["triton_kernel_names"] > 0) if args.compile and cuda else None,
    )
    if cuda:  # the profiler's own overhead stretches its window: also against the timed steps
        per_step = prof["gpu_kernel_s"] / max(1, args.profile_steps)
        result["gpu_busy_timed"] = per_step / step_time
    return result


def said(name: str, side: dict) -> str:
    if "error" in side:
        return f"{name} failed ({side['error'].splitlines()[-1]})"
    if "tokens_per_s" not in side:
        return f"{name} built ({side['params_total']:,} params) but not trained on this device"
    mem = f", {side['peak_mem_gib']:.1f} GiB" if side["peak_mem_gib"] is not None else ""
    busy = ""
    if side["gpu_busy"] is not None:
        busy = f", GPU busy {side['gpu_busy_timed']:.0%} ({side['gpu_busy']:.0%} profiled)"
    return (
        f"{name} {side['tokens_per_s']:,.0f} tok/s, {1000 * side['step_time_s']:.0f} ms{mem}"
        f"{busy}, {side['optimizer_impl']} AdamW"
    )


def compare(args, ours: dict, theirs: dict) -> dict:
    """MFU of each side (our model's FLOPs per token, the device's peak) and ours over
    torchtitan; a compiled ratio only where torchtitan's compile is seen to have run."""
    out: dict = {}
    if "tokens_per_s" not in ours or "tokens_per_s" not in theirs:
        return out
    flops, peak = ours["flops_per_token"], ours["peak_flops"]
    for side in (ours, theirs):
        side["mfu"] = side["tokens_per_s"] * flops / peak if peak else None
    if args.compile and theirs["compile_took_effect"] is not True:
        seen = "not checked on CPU" if theirs["compile_took_effect"] is None else "no Triton"
        out["ratio_withheld"] = f"torchtitan's compile not seen to take effect ({seen})"
        return out
    mem = ours["peak_mem_gib"], theirs["peak_mem_gib"]
    out["ours_over_torchtitan"] = {
        "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "peak_mem": mem[0] / mem[1] if None not in mem else None,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="default 4 (2 with --tiny)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --tiny)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step, both")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled, after timing")
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

    result = {"benchmark": "vs_torchtitan", "command": " ".join(sys.argv[1:]),
              "device": args.device, "compile": args.compile, "warmup": args.warmup,
              "steps": args.steps, "profile_steps": args.profile_steps, "seq_len": args.seq,
              "micro_batch_size": 1, "accum": args.accum,
              "timed": "each side's steps, batches built beforehand (not timed), their copy "
                       "to the device timed",
              "shapes": shapes_of(args)}  # fmt: skip
    # NOTE: a process per side, in turn (so not interleaved): a 4-layer side fills most of an
    # H100, peak memory is per process, and torchtitan's compile sets dynamo flags globally.
    for side in ("ours", "torchtitan"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "side.json")  # the child's: the last --json wins
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], f"--side={side}"]
            proc = subprocess.run([*cmd, f"--json={out}"], capture_output=True, text=True)
            if proc.returncode:  # keep the other side's numbers; say why this one has none
                text = (proc.stderr or proc.stdout).strip()
                # A device-side assert prints its kernel's condition long before the trace.
                asserts = sorted({ln for ln in text.splitlines() if "Assertion" in ln})[:5]
                result[side] = {"error": text[-3000:], "asserts": asserts}
                continue
            with open(out) as f:
                result[side] = json.load(f)
    ours, theirs = result["ours"], result["torchtitan"]
    result.update(compare(args, ours, theirs))
    result["differences"] = DIFFERENCES
    write_result(result, args.json)
    how = f"{args.device}{', compiled' if args.compile else ''}{', tiny' if args.tiny else ''}"
    summary = f"vs torchtitan, {args.layers} layers x seq {args.seq} x {args.accum} ({how}): "
    summary += f"{said('ours', ours)}; {said('torchtitan', theirs)}"
    if "ours_over_torchtitan" in result:
        summary += f"; ours/torchtitan {result['ours_over_torchtitan']['tokens_per_s']:.2f}x tok/s"
    elif "ratio_withheld" in result:
        summary += f"; no ratio: {result['ratio_withheld']}"
    print(summary)


if __name__ == "__main__":
    main()
