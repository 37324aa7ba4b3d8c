"""FP8 training against bf16: do the loss curves of the same run agree within FP8's bound?

    python benchmarks/fp8_numerics.py [--configs configs/debug_qwen3_moe.toml
        configs/debug_deepseek_v3.toml] [--steps 100] [--nproc 1] [--json FILE]
        [-- OVERRIDE...]

OVERRIDE: train.py keys for every run (e.g. --data.seq_len=64 on a busy machine).

Trains each config through `train.py` on CPU, the same seed, data and schedule, with bf16
compute (`train.mixed_precision=bf16`) and `train.fp8` none (the bf16 baseline), rowwise
and tensorwise, and compares the losses with the baseline's, per step and as a 20-step
moving average (single steps of a small batch are noisy in any precision).

The bound (docs/parallelisms.md, "FP8 training"): the final 20-step average of an FP8 run
within u = 2^-4 (e4m3's unit roundoff, 6.25%) of bf16's, relative. Every FP8 GEMM rounds
each input once with a relative error of at most u (bf16: 2^-8), so its output is off by
at most about 2u, and by about u in the root mean square; training that stays within u of
the baseline's loss has absorbed that rounding as noise. A loss further off than one
rounding of its own value means the error compounds: saturation, underflow, a wrong scale
or gradient. Both runs must also stay finite and fall.

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
U_E4M3 = 2.0**-4  # e4m3's unit roundoff: 3 mantissa bits
RECIPES = ("none", "rowwise", "tensorwise")


def train(
    config: str, steps: int, nproc: int, recipe: str, out_dir: str, overrides: list[str]
) -> dict:
    argv = [
        f"--config={config}",
        *overrides,
        f"--train.steps={steps}",
        "--train.mixed_precision=bf16",
        f"--train.fp8={recipe}",
    ]
    records, seconds, _ = train_run(argv, nproc, out_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    return {"losses": losses, "seconds": seconds}


def moving_average(xs: list[float], window: int) -> list[float]:
    return [sum(xs[i - window : i]) / window for i in range(window, len(xs) + 1)]


def compare(bf16: list[float], fp8: list[float]) -> dict:
    window = min(WINDOW, len(bf16))
    per_step = [abs(f - b) / b for b, f in zip(bf16, fp8, strict=True)]
    b_avg, f_avg = moving_average(bf16, window), moving_average(fp8, window)
    final = abs(f_avg[-1] - b_avg[-1]) / b_avg[-1]
    finite = all(math.isfinite(x) for x in bf16 + fp8)
    return {
        "steps": len(bf16),
        "per_step_rel_max": max(per_step),
        "per_step_rel_mean": sum(per_step) / len(per_step),
        "avg_rel_final": final,
        "bound": U_E4M3,
        "within_bound": final <= U_E4M3,
        "bf16_first_last": [bf16[0], bf16[-1]],
        "fp8_first_last": [fp8[0], fp8[-1]],
        "bf16_last_avg": b_avg[-1],
        "fp8_last_avg": f_avg[-1],
        "both_finite": finite,
        "both_fall": finite and b_avg[-1] < 0.8 * bf16[0] and f_avg[-1] < 0.8 * fp8[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["configs/debug_qwen3_moe.toml", "configs/debug_deepseek_v3.toml"],
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--json", help="write the result here instead of stdout")
    p.add_argument("overrides", nargs="*", help="train.py keys for every run (after --)")
    args = p.parse_args()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fp8-bench-") as tmp:
        for config in args.configs:
            name = os.path.basename(config).removesuffix(".toml")
            runs[name] = {
                recipe: train(
                    config, args.steps, args.nproc, recipe, f"{tmp}/{name}-{recipe}", args.overrides
                )
                for recipe in RECIPES
            }
    comparisons = {
        name: {r: compare(by[RECIPES[0]]["losses"], by[r]["losses"]) for r in RECIPES[1:]}
        for name, by in runs.items()
    }
    result = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/fp8_numerics.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPU cores, {platform.platform()}",
        "configs": args.configs,
        "overrides": args.overrides,
        "nproc": args.nproc,
        "seconds": {n: {r: v["seconds"] for r, v in by.items()} for n, by in runs.items()},
        "comparison": comparisons,
        "losses": {n: {r: v["losses"] for r, v in by.items()} for n, by in runs.items()},
    }
    parts = [
        f"{name} {recipe} {100 * c['avg_rel_final']:.2f}%"
        for name, by in comparisons.items()
        for recipe, c in by.items()
    ]
    ok = all(
        c["within_bound"] and c["both_fall"] for by in comparisons.values() for c in by.values()
    )
    result["summary"] = (
        f"FP8 vs bf16 over {args.steps} steps (CPU): final {WINDOW}-step average loss off by "
        f"{', '.join(parts)}; bound u = 2^-4 = 6.25%: {'all within' if ok else 'NOT all within'}"
    )
    write_result(result, args.json)
    print(result["summary"])


if __name__ == "__main__":
    main()
