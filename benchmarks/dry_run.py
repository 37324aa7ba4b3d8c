"""Planning time and memory of the dry-run planner on the shipped large configs.

    python benchmarks/dry_run.py [--out FILE.json]

Runs `python -m moetrain.planner` once per case in a fresh process and records its wall
time, the process's peak RSS, the exact command and the plan (per-rank state, activation
peaks per checkpointing mode, per-step communication). Prints one JSON object, then a
one-line summary. The goal (issue "Memory at scale"): each case under 60 s and 4 GiB on a
2-core CPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "qwen3_30b_a3b_8_ranks": ["--world-size=8", "--config", "configs/qwen3_30b_a3b.toml",
                              "--gpu-memory=80"],
    "deepseek_v3_671b_2048_ranks": ["--world-size=2048", "--config",
                                    "configs/deepseek_v3_671b.toml", "--parallel.ep=64",
                                    "--train.global_batch_size=2048", "--gpu-memory=80"],
    "qwen3_235b_a22b_256_ranks": ["--world-size=256", "--config",
                                  "configs/qwen3_235b_a22b.toml", "--parallel.ep=8",
                                  "--train.global_batch_size=256", "--gpu-memory=80"],
}  # fmt: skip


def run_case(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as stdout:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moetrain.planner", *args, "--json", out],
                cwd=ROOT, stdout=stdout, text=True,
            )  # fmt: skip
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
            wall = time.perf_counter() - start
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"failed: {args}")
            stdout.seek(0)
            printed = stdout.read()
        with open(out) as f:
            plan = json.load(f)
    plan.pop("per_rank")  # thousands of rows; the printed table collapses them
    return {
        "command": "python -m moetrain.planner " + " ".join(args),
        "wall_s": round(wall, 1),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),  # ru_maxrss is in KiB on Linux
        "printed": printed,
        "plan": plan,
    }


def report(record: dict, out_path: str | None) -> None:
    """Print `record` as JSON with the date and machine first, and write it to `out_path`."""
    text = json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "device": f"CPU only, {os.cpu_count()} cores",
         **record},
        indent=1,
    )  # fmt: skip
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)


def main() -> None:
    argv = sys.argv[1:]
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    cases = {name: run_case(args) for name, args in CASES.items()}
    report({"cases": cases}, out_path)
    print(
        "dry run: "
        + "; ".join(
            f"{name} {r['wall_s']} s, {r['peak_rss_gib']} GiB RSS" for name, r in cases.items()
        )
    )


if __name__ == "__main__":
    main()
