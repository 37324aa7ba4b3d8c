"""The planner's step-time estimate for DeepSeek-V3 671B on 2,048 H800 with each way of
overlapping the expert all-to-all (`parallel.ep_overlap`: none, shared, chunks).

    python benchmarks/overlap_estimates.py [--out FILE.json]

One `python -m moetrain.planner` per layout and form, in a fresh process
(`benchmarks/dry_run.py`'s `run_case`); the layouts are those of the table in
docs/planner.md ("Pipeline stages in the planner"), global batch 16,384 x 4096, full
checkpointing (DualPipeV: none, which it needs). An estimate of the model the docs state, not a measurement. Prints one JSON
object, then a one-line summary.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dry_run  # noqa: E402  (benchmarks/dry_run.py)

BASE = ["--world-size=2048", "--config", "configs/deepseek_v3_671b.toml",
        "--train.global_batch_size=16384", "--hardware=h800", "--gpu-memory=80",
        "--train.activation_checkpoint=full"]  # fmt: skip
LAYOUTS = {
    "pp1_ep64_mb1": ["--parallel.ep=64"],
    "pp16_ep64_1f1b_mb1": ["--parallel.pp=16", "--parallel.pp_schedule=1F1B",
                           "--parallel.ep=64"],
    "pp8_ep16_interleaved_mb1": ["--parallel.pp=8", "--parallel.pp_schedule=Interleaved1F1B",
                                 "--parallel.pp_virtual_stages=2", "--parallel.ep=16"],
    "pp1_ep16_mb4": ["--parallel.ep=16", "--train.micro_batch_size=4"],
    # DualPipeV refuses checkpointing (and so does not fit 80 GiB here); with an overlap
    # form its pairs of a forward and a backward also hide each other's all-to-all
    "pp16_ep64_dualpipev_mb1_no_ac": ["--parallel.pp=16", "--parallel.pp_schedule=DualPipeV",
                                      "--parallel.ep=64", "--train.activation_checkpoint=none"],
}  # fmt: skip
FORMS = ("none", "shared", "chunks")


def main() -> None:
    argv = sys.argv[1:]
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    cases = {}
    for name, layout in LAYOUTS.items():
        for form in FORMS:
            case = dry_run.run_case([*BASE, *layout, f"--parallel.ep_overlap={form}"])
            est = case["plan"]["estimate"]
            cases[f"{name}_{form}"] = {
                "command": case["command"],
                "step_s": est["step_s"],
                "tokens_per_s_per_gpu": est["tokens_per_s"] / 2048,
                "all_to_all_s": est["comm_s"]["ep_all_to_all"],
                "all_to_all_hidden_s": est.get("ep_hidden_s"),  # (not split out under pp)
                "bubble_s": est.get("bubble_s"),
                "peak_gib": case["plan"]["peak"] / 2**30,  # the configured mode's rank peak
            }
    dry_run.report({"cases": cases}, out_path)
    print(
        "step estimates (s), none / shared / chunks: "
        + "; ".join(
            f"{name} " + " / ".join(f"{cases[f'{name}_{f}']['step_s']:.1f}" for f in FORMS)
            for name in LAYOUTS
        )
    )


if __name__ == "__main__":
    main()
