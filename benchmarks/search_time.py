"""How long `python -m moetrain.planner --search` takes on the shipped DeepSeek-V3 671B config.

    python benchmarks/search_time.py [--out FILE.json] [--cases NAME,...] [--root DIR]

Runs the search once per case in a fresh process (`benchmarks/dry_run.py`'s `run_case`:
wall time, peak RSS, the exact command) and records how many layouts it ranked and the
fastest. `--root DIR` runs the planner of another checkout of this repository (an older
commit, for a before/after). Prints one JSON object, then a one-line summary. The goal
(issue "Pipeline parallelism"): the search for DeepSeek-V3 on 2,048 ranks under 60 s (by
default it measures in worker processes too: `--workers`; the `_one_process` case without).
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dry_run  # noqa: E402  (benchmarks/dry_run.py)

CASES = {
    "deepseek_v3_671b_256_ranks": ["--world-size=256", "--config",
                                   "configs/deepseek_v3_671b.toml",
                                   "--train.global_batch_size=2048", "--hardware=h800",
                                   "--gpu-memory=80", "--search"],
    "deepseek_v3_671b_2048_ranks": ["--world-size=2048", "--config",
                                    "configs/deepseek_v3_671b.toml",
                                    "--train.global_batch_size=16384", "--hardware=h800",
                                    "--gpu-memory=80", "--search"],
    # the same in this process alone (no worker processes): what the pool adds
    "deepseek_v3_671b_2048_ranks_one_process": [
        "--world-size=2048", "--config", "configs/deepseek_v3_671b.toml",
        "--train.global_batch_size=16384", "--hardware=h800", "--gpu-memory=80", "--search",
        "--workers=0"],
}  # fmt: skip


def flag(argv: list[str], name: str, default: str | None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def main() -> None:
    argv = sys.argv[1:]
    out_path = flag(argv, "--out", None)
    names = (flag(argv, "--cases", None) or ",".join(CASES)).split(",")
    root = os.path.abspath(flag(argv, "--root", dry_run.ROOT))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    dry_run.ROOT = root  # run_case runs the planner there
    cases = {}
    for name in names:
        result = dry_run.run_case(CASES[name])
        ranked = result.pop("plan").get("search", [])
        cases[name] = {
            "command": result["command"],
            "wall_s": result["wall_s"],
            "peak_rss_gib": result["peak_rss_gib"],
            "layouts_ranked": len(ranked),
            "fastest": {k: ranked[0].get(k) for k in ("pp", "pp_schedule", "dp_replicate", "dp_shard", "cp", "ep",
                                                  "micro_batch_size", "activation_checkpoint",
                                                  "step_s")} if ranked else None,
        }  # fmt: skip
    dry_run.report({"planner_commit": commit, "cases": cases}, out_path)
    print("search: " + "; ".join(f"{n} {r['wall_s']} s" for n, r in cases.items()))


if __name__ == "__main__":
    main()
