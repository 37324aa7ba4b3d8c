"""The planner on DeepSeek-V3 671B at DeepSeek's own degrees (pp 16 x ep 64 on 2,048 H800,
"80 GB": 79.6 GiB exposed, 2 GiB of it kept back), beside the throughput DeepSeek's report
gives for that layout: the table of issue 57, again, and the published layout itself
(DualPipeV, global batch 15,360 x 4096, `selective` recomputation, Adam's moments in bf16),
in bf16 and with FP8 GEMMs (`train.fp8=rowwise`, as DeepSeek trained: issue 66).

    python benchmarks/deepseek_v3_published.py [--out FILE.json]

One `python -m moetrain.planner` per row in a fresh process (`benchmarks/dry_run.py`'s
`run_case`). An estimate of the model docs/planner.md states ("DeepSeek's published
layout"), not a measurement. Prints one JSON object, then a one-line summary.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dry_run  # noqa: E402  (benchmarks/dry_run.py)

# DeepSeek-V3's report: about 1,543 tokens/s per H800 (its 180K GPU hours per trillion tokens)
DEEPSEEK_TOKENS_PER_S_PER_GPU = 1e12 / (180e3 * 3600)
BASE = ["--world-size=2048", "--config", "configs/deepseek_v3_671b.toml", "--hardware=h800",
        "--gpu-memory=79.6", "--parallel.pp=16", "--parallel.ep=64"]  # fmt: skip
ROWS = {
    "1f1b_full_none": ["--train.global_batch_size=16384", "--parallel.pp_schedule=1F1B",
                       "--train.activation_checkpoint=full", "--parallel.ep_overlap=none"],
    "1f1b_full_chunks": ["--train.global_batch_size=16384", "--parallel.pp_schedule=1F1B",
                         "--train.activation_checkpoint=full", "--parallel.ep_overlap=chunks"],
    "dualpipev_none_chunks": ["--train.global_batch_size=16384", "--parallel.pp_schedule=DualPipeV",
                              "--train.activation_checkpoint=none", "--parallel.ep_overlap=chunks"],
    "published": ["--train.global_batch_size=15360", "--parallel.pp_schedule=DualPipeV",
                  "--train.activation_checkpoint=selective", "--parallel.ep_overlap=chunks",
                  "--train.optimizer_state_dtype=bf16"],
    "published_fp8": ["--train.global_batch_size=15360", "--parallel.pp_schedule=DualPipeV",
                      "--train.activation_checkpoint=selective", "--parallel.ep_overlap=chunks",
                      "--train.optimizer_state_dtype=bf16", "--train.fp8=rowwise"],
}  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    rows = {}
    for name, flags in ROWS.items():
        case = dry_run.run_case([*BASE, *flags])
        plan, est = case["plan"], case["plan"]["estimate"]
        rows[name] = {
            "command": case["command"],
            "step_s": est["step_s"],
            "tokens_per_s_per_gpu": est["tokens_per_s"] / 2048,
            "of_deepseek": est["tokens_per_s"] / 2048 / DEEPSEEK_TOKENS_PER_S_PER_GPU,
            "compute_s": est["compute_s"],
            "all_to_all_s": est["comm_s"]["ep_all_to_all"],
            "node_share": est["node_share"],
            "bubble_s": est.get("bubble_s"),
            "optimizer_s": est["optimizer_s"],
            "busiest_load": est.get("busiest_load"),
            "precision": est["precision"],
            "peak_gib": plan["peak"] / 2**30,
            "usable_gib": plan["usable_gib"],
            "fits": plan["fits"],
            "routing_imbalance": plan["routing_imbalance"],
            "routing_imbalance_gib": plan["routing_imbalance_bytes"] / 2**30,
            "stage_inputs_gib": max(q["inputs_bytes"] for q in plan["pipeline"]["pp_ranks"])
            / 2**30,
            "pp_rank_activations_gib": [q["activations"] for q in plan["pipeline"]["pp_ranks"]],
            "parameters": plan["parameters"],
            "printed": case["printed"],
        }
    dry_run.report({"deepseek_tokens_per_s_per_gpu": DEEPSEEK_TOKENS_PER_S_PER_GPU,
                    "rows": rows}, out_path)  # fmt: skip
    print(
        "tok/s/GPU (of DeepSeek's 1,543), peak GiB: "
        + "; ".join(
            f"{k} {r['tokens_per_s_per_gpu']:,.0f} ({r['of_deepseek']:.0%}), {r['peak_gib']:.1f}"
            for k, r in rows.items()
        )
    )


if __name__ == "__main__":
    main()
