"""bf16 mixed precision against fp32: do the loss curves of the same run agree?

    python benchmarks/bf16.py [--config configs/debug_qwen3_moe.toml] [--steps 300]
        [--nproc 2] [--json FILE]

Trains the config twice through `train.py` on `--nproc` CPU ranks (gloo), the same seed,
data and schedule, with `train.mixed_precision=fp32` and `=bf16` (fp32 master weights,
optimizer state and gradient reduction; bf16 compute), and compares the logged losses:
per step, and as a 20-step moving average (the curve a person reads; single steps of a
small batch are noisy in either precision). Both runs must stay finite and fall.

Prints one JSON object (or writes --json FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
import tempfile

from report import train_run, write_result  # noqa: E402  (this script's folder is on sys.path)

WINDOW = 20  # steps in the moving average


def train(config: str, steps: int, nproc: int, precision: str, out_dir: str) -> dict:
    argv = [f"--config={config}", f"--train.steps={steps}", f"--train.mixed_precision={precision}"]
    records, seconds, _ = train_run(argv, nproc, out_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    return {"losses": losses, "seconds": seconds}


def moving_average(xs: list[float], window: int) -> list[float]:
    return [sum(xs[i - window : i]) / window for i in range(window, len(xs) + 1)]


def compare(fp32: list[float], bf16: list[float]) -> dict:
    per_step = [abs(b - f) / f for f, b in zip(fp32, bf16, strict=True)]
    f_avg, b_avg = moving_average(fp32, WINDOW), moving_average(bf16, WINDOW)
    smooth = [abs(b - f) / f for f, b in zip(f_avg, b_avg, strict=True)]
    finite = all(math.isfinite(x) for x in fp32 + bf16)
    return {
        "steps": len(fp32),
        "per_step_rel_max": max(per_step),
        "per_step_rel_mean": sum(per_step) / len(per_step),
        f"avg{WINDOW}_rel_max": max(smooth),
        f"avg{WINDOW}_rel_final": smooth[-1],
        "fp32_first_last": [fp32[0], fp32[-1]],
        "bf16_first_last": [bf16[0], bf16[-1]],
        "fp32_last_avg": f_avg[-1],
        "bf16_last_avg": b_avg[-1],
        "both_finite": finite,
        "both_fall": finite and f_avg[-1] < 0.6 * fp32[0] and b_avg[-1] < 0.6 * bf16[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/debug_qwen3_moe.toml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", help="write the result here instead of stdout")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bf16-bench-") as tmp:
        runs = {prec: train(args.config, args.steps, args.nproc, prec, os.path.join(tmp, prec))
                for prec in ("fp32", "bf16")}  # fmt: skip
    result = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/bf16.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPU cores, {platform.platform()}",
        "config": args.config,
        "nproc": args.nproc,
        "seconds": {k: v["seconds"] for k, v in runs.items()},
        "comparison": compare(runs["fp32"]["losses"], runs["bf16"]["losses"]),
        "losses": {k: v["losses"] for k, v in runs.items()},
    }
    c = result["comparison"]
    result["summary"] = (
        f"bf16 vs fp32 over {c['steps']} steps of {args.config}: {WINDOW}-step average loss "
        f"within {100 * c[f'avg{WINDOW}_rel_max']:.2f}% (final "
        f"{100 * c[f'avg{WINDOW}_rel_final']:.2f}%), single steps within "
        f"{100 * c['per_step_rel_max']:.2f}%; final average {c['fp32_last_avg']:.3f} fp32 vs "
        f"{c['bf16_last_avg']:.3f} bf16; both finite and falling: {c['both_fall']}"
    )
    write_result(result, args.json)
    print(result["summary"])


if __name__ == "__main__":
    main()
