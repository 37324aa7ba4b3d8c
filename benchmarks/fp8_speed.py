"""FP8 against bf16 from the runs of `benchmarks/gpu_suite.sh fp8`: step time, throughput,
memory and loss of each recipe next to bf16's (`train.fp8=none`) in the same mode.

    python benchmarks/fp8_speed.py --results RESULTS_JSON [--json FILE] NAME...

NAME: the suite's run names, `fp8_<recipe>_<mode>` (recipe none | rowwise | tensorwise,
mode eager | compile); RESULTS_JSON: the suite's results.json, whose `train.<NAME>` holds
each run's summary (benchmarks/gpu_lib.sh). A run that failed or is missing is reported
as such, not compared. Prints one JSON object (or writes --json FILE), then a one-line
summary.
"""

from __future__ import annotations

import argparse
import json

from report import write_result  # noqa: E402  (this script's folder is on sys.path)


def compare(summaries: dict[str, dict], names: list[str]) -> dict[str, dict]:
    """{mode: {recipe: figures}}: each FP8 recipe against bf16 in its mode."""
    by_mode: dict[str, dict[str, dict]] = {}
    for name in names:
        _, recipe, mode = name.split("_", 2)
        by_mode.setdefault(mode, {})[recipe] = summaries.get(name) or {"error": "no run"}
    out = {}
    for mode, runs in by_mode.items():
        base = runs.get("none", {})
        out[mode] = {}
        for recipe, run in runs.items():
            if "error" in run or "median_step_s" not in run:
                out[mode][recipe] = {"error": run.get("error", "no summary")}
                continue
            figures = {
                "median_step_s": run["median_step_s"],
                "median_tokens_per_s": run["median_tokens_per_s"],
                "peak_mem_gib": run["peak_mem_gib"],
                "loss_first": run["loss_first"],
                "loss_last": run["loss_last"],
            }
            if recipe != "none" and "median_step_s" in base:
                figures["speedup_vs_bf16"] = base["median_step_s"] / run["median_step_s"]
                figures["loss_last_rel_vs_bf16"] = (
                    abs(run["loss_last"] - base["loss_last"]) / base["loss_last"]
                )
            out[mode][recipe] = figures
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", required=True, help="gpu_suite.sh's results.json")
    p.add_argument("--json", help="write the result here instead of stdout")
    p.add_argument("names", nargs="+", help="fp8_<recipe>_<mode> run names")
    args = p.parse_args()
    with open(args.results) as f:
        summaries = json.load(f).get("train", {})
    comparison = compare(summaries, args.names)
    parts = [
        f"{mode} {recipe} {fig['speedup_vs_bf16']:.2f}x (loss {fig['loss_last']:.3f})"
        for mode, runs in comparison.items()
        for recipe, fig in runs.items()
        if "speedup_vs_bf16" in fig
    ]
    failed = [f"{m} {r}" for m, runs in comparison.items() for r, f in runs.items() if "error" in f]
    summary = "FP8 step time against bf16: " + ("; ".join(parts) or "nothing compared")
    if failed:
        summary += f"; no result: {', '.join(failed)}"
    write_result({"comparison": comparison, "summary": summary}, args.json)
    print(summary)


if __name__ == "__main__":
    main()
