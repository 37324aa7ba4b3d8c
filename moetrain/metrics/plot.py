"""`python -m moetrain.metrics.plot OUTPUT_DIR [--out DIR]`: pictures of a run from its metrics.jsonl.

Writes PNGs next to it (or in --out): loss (with the held-out loss, per source for a blend,
aux, z and MTP losses when logged), DPO's rewards and accuracy (rewards.png), learning
rate, grad norm, tokens/s, the balance of each MoE layer (max/mean load, starved experts),
and one heatmap per MoE layer of its expert load over the steps
(each step's row relative to its mean: 1 is balanced). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys

from moetrain.metrics.logger import read_records


def _save(fig, out: str) -> None:
    """Write the PNG beside, then rename: an open viewer never reads half a picture."""
    fig.savefig(out + ".tmp", dpi=100, format="png")
    os.replace(out + ".tmp", out)


def _curves(plt, records: list[dict], keys: list[str], title: str, out: str, log: bool) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), label=key)
    ax.set(xlabel="step", title=title)
    if log:
        ax.set_yscale("log")
    if len(keys) > 1:
        ax.legend()
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def _expert_load(plt, records: list[dict], out_dir: str) -> list[str]:
    import numpy as np

    rows = [(r["step"], r["expert_load"]) for r in records if r.get("expert_load")]
    if not rows:
        return []
    steps = [s for s, _ in rows]
    load = np.asarray([counts for _, counts in rows], dtype=np.float64)  # [steps, L, E]
    written = []
    for layer in range(load.shape[1]):
        share = load[:, layer] / np.maximum(load[:, layer].mean(axis=1, keepdims=True), 1e-9)
        fig, ax = plt.subplots(figsize=(7, 4))
        image = ax.imshow(
            share,
            aspect="auto",
            cmap="viridis",
            interpolation="nearest",
            extent=(-0.5, share.shape[1] - 0.5, steps[-1], steps[0]),
        )
        fig.colorbar(image, ax=ax, label="tokens / mean")
        ax.set(xlabel="expert", ylabel="step", title=f"expert load, MoE layer {layer}")
        fig.tight_layout()
        out = os.path.join(out_dir, f"expert_load_layer{layer}.png")
        _save(fig, out)
        plt.close(fig)
        written.append(out)
    return written


def _balance(plt, records: list[dict], out: str) -> list[str]:
    """Per MoE layer over the steps: the busiest expert's load over the mean (1 = even, the
    ceiling E/k = all tokens on k experts) and the experts under 10% of the mean."""
    rows = [r for r in records if r.get("expert_load_max_over_mean")]
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for layer in range(len(rows[0]["expert_load_max_over_mean"])):
        top.plot(
            steps, [r["expert_load_max_over_mean"][layer] for r in rows], label=f"layer {layer}"
        )
        starved = [r.get("expert_load_starved", [0] * (layer + 1))[layer] for r in rows]
        bottom.plot(steps, starved, label=f"layer {layer}")
    top.set(ylabel="max / mean load", title="expert load balance per MoE layer")
    bottom.set(xlabel="step", ylabel="experts < 10% of mean")
    top.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out]


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: moetrain.metrics.plot takes a run's job.output_dir (with "
            "metrics.jsonl, which metrics.jsonl=true writes)"
        )
    records, dropped = read_records(path)
    if dropped:  # e.g. a half-written last line after a kill
        print(f"note: {path}: skipped {len(dropped)} line(s) that do not parse", file=sys.stderr)
    if not records:
        raise FileNotFoundError(f"{path} holds no steps yet")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    figure = os.path.join
    per_source = sorted({k for r in records for k in r if k.startswith("eval_loss/")})
    losses = ["loss", "eval_loss", *per_source, "aux_loss", "z_loss", "mtp_loss"]
    return [
        _curves(plt, records, losses, "losses", figure(out_dir, "loss.png"), True),
        _curves(plt, records, ["lr"], "learning rate", figure(out_dir, "lr.png"), False),
        _curves(
            plt,
            records,
            ["grad_norm"],
            "grad norm (before clipping)",
            figure(out_dir, "grad_norm.png"),
            True,
        ),
        _curves(
            plt, records, ["tokens_per_s"], "tokens/s", figure(out_dir, "tokens_per_s.png"), False
        ),
        *_balance(plt, records, figure(out_dir, "balance.png")),
        *_expert_load(plt, records, out_dir),
        *_rewards(plt, records, figure(out_dir, "rewards.png")),
    ]


# train.objective=dpo: the implicit rewards of the pairs, trained and held out.
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")


def _rewards(plt, records: list[dict], out: str) -> list[str]:
    keys = [k for name in REWARDS for k in (name, f"eval_{name}")]
    if not any(k in r for r in records for k in keys):
        return []
    return [_curves(plt, records, keys, "DPO rewards (beta * log-ratio) and accuracy", out, False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moetrain.metrics.plot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", help="a run's job.output_dir")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: run_dir)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        print(
            "error: moetrain.metrics.plot needs matplotlib: pip install matplotlib", file=sys.stderr
        )
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
