"""Held-out evaluation and blended data: what they cost.

    python benchmarks/eval_mix.py [--config configs/debug_qwen3_moe.toml] [--steps 6]
        [--sources 5] [--samples 200000] [--json FILE]

- eval vs training throughput: one rank trains `--steps` steps of the config and evaluates
  `eval.samples` = one global batch of held-out samples after each (eval.fraction=0.05);
  tokens/s of each (the first step and the first evaluation are left out: warm-up).
- the blended order: `--samples` stream positions of a `--sources`-way blend read through
  `GlobalBatchSampler` (global batch 1024, rank 0 of 8), against the single-corpus order
  over as many samples: microseconds per sample.

Prints one JSON object (or writes --json FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from report import write_result  # noqa: E402  (this script's folder is on sys.path)


def eval_vs_train(config: str, steps: int) -> dict:
    import torch.distributed as dist

    from moetrain.config import load_config
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer
    from moetrain.parallelisms.dims import ParallelDims

    cfg = load_config(["--config", config, "--eval.fraction=0.05", "--metrics.jsonl=false"])
    cfg.eval.samples = cfg.train.global_batch_size
    dims = ParallelDims.resolve(1, -1, 1, 1, 1)
    corpora = preflight(cfg, dims)
    trainer = Trainer(cfg, dims, corpora)
    train_s, eval_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.steps.train_step(trainer.next_micro_batches())
        t1 = time.perf_counter()
        trainer.evaluate()
        train_s.append(t1 - t0)
        eval_s.append(time.perf_counter() - t1)
    dist.destroy_process_group()
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    train_tps = tokens * (steps - 1) / sum(train_s[1:])
    eval_tps = tokens * (steps - 1) / sum(eval_s[1:])
    return {"tokens_per_round": tokens, "train_tokens_per_s": train_tps,
            "eval_tokens_per_s": eval_tps, "eval_over_train": eval_tps / train_tps}  # fmt: skip


def blended_order(sources: int, samples: int) -> dict:
    from moetrain.data.mixture import BlendedOrder
    from moetrain.data.sampler import GlobalBatchSampler

    sizes = [1_000_000 + 7919 * i for i in range(sources)]
    weights = [1.0 / (i + 1) for i in range(sources)]
    batch, dp, micro = 1024, 8, 8

    def per_sample(blend: BlendedOrder | None) -> float:
        sampler = GlobalBatchSampler(sum(sizes), batch, micro, 0, dp, 0, True, blend=blend)
        read, t0 = 0, time.perf_counter()
        while read < samples // dp:
            read += len(sampler.next_micro_batch())
        return (time.perf_counter() - t0) / read * 1e6

    keys = [f"s{i}" for i in range(sources)]
    blend_us = per_sample(BlendedOrder(keys, sizes, weights, batch, 0, True))
    plain_us = per_sample(None)
    # Each rank also replays the interleave of the whole global batch once per step: that
    # cost is inside blend_us, spread over the rank's own samples (1/dp of the batch).
    return {"sources": sources, "samples_read_rank0": samples // dp, "dp": dp,
            "global_batch": batch, "blend_us_per_sample": blend_us,
            "single_corpus_us_per_sample": plain_us}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/debug_qwen3_moe.toml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sources", type=int, default=5)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.chdir(ROOT)
    import torch

    result = {
        "command": shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },  # fmt: skip
        "eval_vs_train": eval_vs_train(args.config, args.steps),
        "blended_order": blended_order(args.sources, args.samples),
    }
    write_result(result, args.json)
    e, b = result["eval_vs_train"], result["blended_order"]
    print(
        f"eval_mix: eval {e['eval_tokens_per_s']:,.0f} tok/s vs train "
        f"{e['train_tokens_per_s']:,.0f} tok/s ({e['eval_over_train']:.2f}x); blended order "
        f"{b['blend_us_per_sample']:.1f} us/sample ({b['sources']} sources) vs "
        f"{b['single_corpus_us_per_sample']:.1f} us/sample for one corpus"
    )


if __name__ == "__main__":
    main()
