"""`python -m moetrain.generate`'s decoding speed: the full-forward decoder, one prompt at a
time (the command before the KV cache), against the cached decoder, one prompt at a time
and in left-padded batches, on the same prompts and the same model.

    python benchmarks/generate_speed.py [--config configs/debug_qwen3_moe.toml]
        [--prompts 8] [--max-new-tokens 256] [--batch-size 8] [--device cpu] [--threads N]
        [--json FILE]

The model is the config's, randomly initialised from its train.seed (speed does not depend
on the weights), loaded once: only decoding is timed, not the process start and model load
that each prompt paid before --prompts existed. The prompts are byte-tokenized text (the
debug configs' tokenizer) of different lengths, from the docstrings of standard-library
modules. No stop token, so every path makes --max-new-tokens tokens a prompt: the same work.
Greedy decoding: `same_ids` says every path gave every prompt the same tokens. Prints one
JSON object (or writes --json FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODULES = [
    "json",
    "textwrap",
    "argparse",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "random",
    "string",
    "heapq",
    "bisect",
    "shlex",
    "fractions",
    "statistics",
]


def byte_prompts(count: int) -> list[list[int]]:
    """`count` prompts of 24, 40, 56, ... bytes (cycling through 8 lengths), consecutive
    pieces of the modules' docstrings."""
    from moetrain.data.tokenizers import ByteTokenizer

    docs = (importlib.import_module(name).__doc__ or "" for name in MODULES)
    text = " ".join(" ".join(docs).split())
    tok, prompts, start = ByteTokenizer(), [], 0
    for i in range(count):
        length = 24 + 16 * (i % 8)
        piece = (text * (1 + (start + length) // len(text)))[start : start + length]
        prompts.append([int(t) for t in tok.encode(piece)])
        start += length
    return prompts


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(args: argparse.Namespace, result: dict) -> None:
    import torch

    from moetrain.config import load_config
    from moetrain.generate.batched import generate_batch
    from moetrain.generate.decode import generate_uncached
    from moetrain.models import get_model_spec

    cfg = load_config(["--config", args.config])
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.args)
    model.init_weights(cfg.train.seed)
    model = model.eval().to(torch.device(args.device))
    prompts = byte_prompts(args.prompts)
    new = args.max_new_tokens

    def batches(size: int) -> list[list[int]]:
        answers = []
        for begin in range(0, len(prompts), size):
            answers += generate_batch(model, spec.plan, prompts[begin : begin + size], set(), new)
        return [a.ids for a in answers]

    generate_batch(model, spec.plan, prompts[:1], set(), 2)  # warm-up, untimed
    uncached_s, uncached = timed(
        lambda: [generate_uncached(model, p, set(), new)[0] for p in prompts]
    )
    single_s, single = timed(lambda: batches(1))
    batched_s, batched = timed(lambda: batches(args.batch_size))
    n = len(prompts)
    result["model"] = {
        "name": cfg.model.name,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    result["prompt_tokens"] = [len(p) for p in prompts]
    result["paths"] = {
        "uncached_one_at_a_time": {"s": uncached_s, "s_per_prompt": uncached_s / n},
        "cached_one_at_a_time": {"s": single_s, "s_per_prompt": single_s / n},
        f"cached_batch_{args.batch_size}": {"s": batched_s, "s_per_prompt": batched_s / n},
    }
    result["new_tokens_per_prompt"] = new
    result["same_ids"] = uncached == single == batched
    result["speedup_cached_one_at_a_time"] = uncached_s / single_s
    result["speedup_cached_batched"] = uncached_s / batched_s
    result["summary"] = (
        f"{cfg.model.name} ({args.config}), {n} prompts x {new} new tokens on {args.device}: "
        f"full forward {uncached_s / n:.2f} s/prompt, cached {single_s / n:.2f} s/prompt "
        f"({uncached_s / single_s:.1f}x), cached batch {args.batch_size} "
        f"{batched_s / n:.3f} s/prompt ({uncached_s / batched_s:.1f}x); "
        f"same ids: {result['same_ids']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/debug_qwen3_moe.toml")
    p.add_argument("--prompts", type=int, default=8, help="how many prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the JSON here instead of stdout")
    args = p.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    result: dict = {
        "benchmark": "generate_speed",
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }
    measure(args, result)
    with open(args.json, "w") if args.json else contextlib.nullcontext(sys.stdout) as f:
        print(json.dumps(result, indent=1), file=f)
    print(result["summary"])


if __name__ == "__main__":
    main()
