"""Load balance per layer: the aux loss pooled over layers against per layer, with and
without the router z-loss, on the debug Qwen3-MoE and DeepSeek-V3 configs.

    python benchmarks/balance.py [--steps 200] [--nproc 2] [--z 0.001]
        [--models qwen3_moe,deepseek_v3] [--json FILE]

Trains each config four times through `train.py` on `--nproc` CPU ranks (gloo), the same
seed, data and schedule: `moe.aux_loss_layers` = pooled | per_layer, `moe.z_loss_coef` =
0 | --z. Reports, per run, each MoE layer's expert-load max/mean (1 = even, E/k = every
token on the same k experts) and starved experts (under 10% of the mean load) at the first
step and averaged over the last 5 logged loads (every 10 steps), the mean loss of the last
20 steps, and the z-loss. DeepSeek-V3's routers also have the aux-loss-free bias update,
which balances on its own; Qwen3-MoE's have only the aux loss.

Prints one JSON object (or writes --json FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

from report import train_run, write_result  # noqa: E402  (this script's folder is on sys.path)

CONFIGS = {
    "qwen3_moe": "configs/debug_qwen3_moe.toml",
    "deepseek_v3": "configs/debug_deepseek_v3.toml",
}
LAST = 5  # logged loads averaged at the end
WINDOW = 20  # steps in the final mean loss


def train(config: str, steps: int, nproc: int, layers: str, z: float, out_dir: str) -> dict:
    argv = [f"--config={config}", f"--train.steps={steps}", f"--moe.aux_loss_layers={layers}",
            f"--moe.z_loss_coef={z}", "--metrics.expert_load_interval=10"]  # fmt: skip
    records, seconds, command = train_run(argv, nproc, out_dir)
    records = [r for r in records if "loss" in r]
    loads = [r for r in records if "expert_load_max_over_mean" in r]
    last = loads[-LAST:]
    n_layers = len(loads[0]["expert_load_max_over_mean"])

    def mean_of(key: str, layer: int) -> float:
        return round(sum(r[key][layer] for r in last) / len(last), 3)

    return {
        "command": command,
        "seconds": round(seconds, 1),
        "step1_max_over_mean": [round(v, 3) for v in loads[0]["expert_load_max_over_mean"]],
        "step1_starved": loads[0]["expert_load_starved"],
        "end_max_over_mean": [mean_of("expert_load_max_over_mean", i) for i in range(n_layers)],
        "end_starved": [mean_of("expert_load_starved", i) for i in range(n_layers)],
        "end_steps": [r["step"] for r in last],
        "loss_end": round(sum(r["loss"] for r in records[-WINDOW:]) / len(records[-WINDOW:]), 4),
        "aux_loss_end": round(records[-1]["aux_loss"], 5),
        "z_loss_first": round(records[0]["z_loss"], 4),
        "z_loss_end": round(records[-1]["z_loss"], 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--z", type=float, default=0.001, help="z-loss weight of the +z runs")
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for layers in ("pooled", "per_layer"):
                for z in (0.0, args.z):
                    name = f"{model}/{layers}" + ("+z" if z else "")
                    out = os.path.join(tmp, name.replace("/", "_"))
                    runs[name] = train(CONFIGS[model], args.steps, args.nproc, layers, z, out)
                    print(f"{name}: {runs[name]['end_max_over_mean']}", file=sys.stderr)
    verdicts = {}
    for model in args.models.split(","):
        for suffix in ("", "+z"):
            pooled, per_layer = runs[f"{model}/pooled{suffix}"], runs[f"{model}/per_layer{suffix}"]
            verdicts[f"{model}{suffix}"] = {
                "per_layer_below_pooled_every_layer": all(
                    a < b
                    for a, b in zip(per_layer["end_max_over_mean"], pooled["end_max_over_mean"])
                ),
                "worst_layer": [
                    max(pooled["end_max_over_mean"]),
                    max(per_layer["end_max_over_mean"]),
                ],
                "loss_end": [pooled["loss_end"], per_layer["loss_end"]],
            }
    result = {
        "benchmark": "balance",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "steps": args.steps,
        "nproc": args.nproc,
        "z_loss_coef": args.z,
        "runs": runs,
        "verdicts": verdicts,
    }
    summary = "; ".join(
        f"{m}: worst layer max/mean pooled {v['worst_layer'][0]:.2f} -> per-layer "
        f"{v['worst_layer'][1]:.2f}, every layer lower: {v['per_layer_below_pooled_every_layer']}"
        f", loss {v['loss_end'][0]:.3f} -> {v['loss_end'][1]:.3f}"
        for m, v in verdicts.items()
    )
    result["summary"] = summary
    write_result(result, args.json)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
