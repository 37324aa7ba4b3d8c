"""Attention on CUDA: the ring's block kernels per chunk, and the core's time and peak memory.

    python benchmarks/attention_kernels.py [--chunks 4096,8192,16384,32768]
        [--seqs 8192,16384,32768] [--kernels ...] [--core-paths sdpa,flex,flash_attn]
        [--heads 32 --kv-heads 4 --head-dim 128] [--json PATH]

1. Blocks: for each ring block kernel (`parallel.cp_kernel`) and chunk length L, one
   forward and one backward of a causal diagonal block [L x L] and of a full block
   [L x L], bf16, Qwen3-30B-A3B's attention shape; and a block under a document mask
   (the kernels that take one; the others get a row saying so). Median time (CUDA events)
   and the peak memory above the inputs (torch.cuda.max_memory_allocated). The math
   kernel's fp32 scores would take L^2 * Hq * 12 bytes: skipped (and said so) where that
   passes --max-gib. flash_attn (flash-attn-4) is skipped, with the reason, where it
   cannot run (no Hopper/Blackwell GPU, the package missing).
2. Core (cp = 1), forward + backward at seq S, causal and with document masks: what
   `AttentionCore` runs on CUDA (causal: SDPA, `sdpa`; documents: FlexAttention, `flex`, or
   SDPA with its dense [B, 1, S, S] mask, `sdpa`) against flash-attn-4's core (`flash_attn`:
   `flash_attn_func`, and `flash_attn_varlen_func` with documents; their offsets computed
   once for the repeated calls, as once per micro-batch for all layers).

`parallel.cp_kernel=auto` picks flash_attn only once these figures show it faster than the
kernel it picks today (docs/parallelisms.md). One JSON object, then a one-line summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_result  # noqa: E402
from moetrain.models.common.attention import sdpa_attention  # noqa: E402
from moetrain.models.common.flex import flex_attention_core  # noqa: E402
from moetrain.models.common.visibility import Visibility  # noqa: E402
from moetrain.parallelisms.attention_kernels import KERNELS  # noqa: E402
from moetrain.parallelisms.flash_attention import DocumentSpans, FlashAttentionCore  # noqa: E402
from moetrain.parallelisms.flash_attn_support import (  # noqa: E402
    FlashAttnUse,
    flash_attn_problems,
    host_of,
    import_problem,
    refusal,
)

GIB = 2**30


def _documents(b: int, s: int, device, mean: int = 2048) -> torch.Tensor:
    """Document ids with lengths drawn around `mean` (lognormal, fixed seed)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(b, s, dtype=torch.int64)
    for row in range(b):
        at, doc = 0, 0
        while at < s:
            n = max(16, int(mean * torch.exp(0.8 * torch.randn((), generator=g))))
            ids[row, at : at + n] = doc
            at, doc = at + n, doc + 1
    return ids.to(device)


def _timed(fn, iters: int) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before) of fn()."""
    fn()  # warm-up (and compilation)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / GIB


def flash_attn_missing(args) -> str | None:
    """Why flash-attn-4 cannot run this benchmark here (None: it can)."""
    use = FlashAttnUse(torch.bfloat16, args.head_dim, args.head_dim)
    problems = flash_attn_problems(host_of(torch.device("cuda")), use)
    return refusal(problems) if problems else import_problem()


def block_row(name, length, kind, args, iters) -> dict:
    kernel = KERNELS[name]
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    if name == "math" and length * length * hq * 12 / GIB > args.max_gib:
        return {"kernel": name, "chunk": length, "block": kind, "skipped": "math scores too large"}
    if name == "flash_attn" and args.flash_attn_missing is not None:
        return {"kernel": name, "chunk": length, "block": kind, "skipped": args.flash_attn_missing}
    g = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(1, length, hq, d, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, length, hkv, d, generator=g, device="cuda").bfloat16() for _ in "kv")
    causal, mask = kind == "causal", None
    if kind == "documents":
        ids, pos = _documents(1, length, "cuda"), torch.arange(length, device="cuda")
        mask = Visibility(ids, ids, pos, pos, True, None)
    row = {"kernel": name, "chunk": length, "block": kind}
    try:
        out, lse = kernel.forward(q, k, v, d**-0.5, causal, mask)
        grad = torch.randn_like(out)
        row["forward_ms"], row["forward_peak_gib"] = _timed(
            lambda: kernel.forward(q, k, v, d**-0.5, causal, mask), iters
        )
        row["backward_ms"], row["backward_peak_gib"] = _timed(
            lambda: kernel.backward(grad, q, k, v, out, lse, d**-0.5, causal, mask), iters
        )
        pairs = length * (length + 1) / 2 if kind != "full" else length * length
        flops = 4 * pairs * hq * d  # QK^T and PV, 2 FLOPs per multiply-add
        row["forward_tflops"] = flops / row["forward_ms"] / 1e9
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as err:  # a kernel this build or GPU lacks: recorded, the rest goes on
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    torch.cuda.empty_cache()
    return row


def core_row(path: str, seq: int, documents: bool, args, iters: int) -> dict:
    """Forward + backward of the cp = 1 core: `path` sdpa (causal: SDPA's own choice of
    kernel; documents: its dense mask), flex (documents) or flash_attn."""
    row = {"path": path, "seq": seq, "documents": documents}
    if path == "sdpa" and documents:
        row["path"] = "sdpa_dense_mask"
    if path == "flash_attn" and args.flash_attn_missing is not None:
        return {**row, "skipped": args.flash_attn_missing}
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(seq)
    flash = path == "flash_attn"  # its layout is [B, S, H, D], SDPA's and flex's [B, H, S, D]

    def make(heads):
        shape = (1, seq, heads, d) if flash else (1, heads, seq, d)
        return torch.randn(*shape, generator=g, device="cuda").bfloat16().requires_grad_()

    q, k, v = make(hq), make(hkv), make(hkv)
    ids = _documents(1, seq, "cuda") if documents else None
    core = FlashAttentionCore(d**-0.5, True, None, DocumentSpans()) if flash else None
    plain = flex_attention_core if path == "flex" else sdpa_attention

    def step():
        out = core(q, k, v, ids) if flash else plain(q, k, v, ids, True, None, d**-0.5)
        out.backward(torch.ones_like(out))

    try:
        row["fwd_bwd_ms"], row["peak_gib"] = _timed(step, iters)
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as err:  # a kernel this build or GPU lacks: recorded, the rest goes on
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", default="4096,8192,16384,32768")
    p.add_argument("--seqs", default="8192,16384,32768")
    p.add_argument("--kernels", default="sdpa_flash,sdpa_cudnn,sdpa_efficient,flex,flash_attn,math")
    p.add_argument("--core-paths", default="sdpa,flex,flash_attn")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-gib", type=float, default=40.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    args.flash_attn_missing = flash_attn_missing(args)  # asked once: it imports the package
    masked_ok = {"sdpa_efficient", "flex", "math"}
    blocks = []
    for length in map(int, args.chunks.split(",")):
        for name in args.kernels.split(","):
            for kind in ("causal", "full", "documents"):
                if kind == "documents" and name not in masked_ok:
                    skipped = "takes no mask (parallel.cp_kernel refuses it for a masked ring)"
                    blocks.append(
                        {"kernel": name, "chunk": length, "block": kind, "skipped": skipped}
                    )
                    continue
                blocks.append(block_row(name, length, kind, args, args.iters))
                print(blocks[-1], file=sys.stderr, flush=True)
    cores = []
    for seq in map(int, args.seqs.split(",")):
        for documents in (False, True):
            for path in args.core_paths.split(","):
                if path == "flex" and not documents:
                    continue  # the core runs flex only for masks
                cores.append(core_row(path, seq, documents, args, args.iters))
                print(cores[-1], file=sys.stderr, flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "blocks": blocks,
        "cores": cores,
    }
    write_result(result, args.json)
    longest = max(map(int, args.chunks.split(",")))
    best = [r for r in blocks if r.get("chunk") == longest and r.get("block") == "causal"]
    summary = ", ".join(f"{r['kernel']} {r.get('forward_ms', float('nan')):.1f} ms" for r in best)
    core_times = ", ".join(
        f"{r['path']}{'+docs' if r['documents'] else ''}@{r['seq']} "
        f"{r.get('fwd_bwd_ms', float('nan')):.1f} ms {r.get('peak_gib', float('nan')):.2f} GiB"
        for r in cores
    )
    print(f"{longest} causal block fwd: {summary}; cores fwd+bwd: {core_times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
