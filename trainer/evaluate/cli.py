"""`python -m trainer.evaluate`: the held-out loss of saved weights, so that checkpoints can
be compared without training.

    [torchrun --nproc_per_node=N] python -m trainer.evaluate --config X.toml \\
        (--checkpoint DIR | --hf DIR) [--json FILE] [--section.key=value ...]

The config's `[eval]` data (eval.path, [[eval.mix]] or eval.fraction, with eval.samples) is
evaluated as the training run evaluates it, on the layout of `[parallel]` and the world
size: the same loss as the run logged at that step. Exit status 2 for bad input (one
message), as train.py.
"""

from __future__ import annotations

import json
import sys

from parallelisms.dims import ParallelDims, world_size_from_env
from trainer.config import ConfigError, load_config
from trainer.errors import USER_ERRORS

USAGE = (
    "usage: python -m trainer.evaluate --config X.toml (--checkpoint DIR | --hf DIR) "
    "[--json FILE] [--section.key=value ...]"
)


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of `--flag V` or `--flag=V`, and argv without it."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 2)[2])
        return 0
    checkpoint, argv = _take(argv, "--checkpoint")
    hf_dir, argv = _take(argv, "--hf")
    json_path, argv = _take(argv, "--json")
    try:
        if (checkpoint is None) == (hf_dir is None):
            raise ConfigError(f"give exactly one of --checkpoint DIR and --hf DIR\n{USAGE}")
        if hf_dir is not None:
            argv = [*argv, f"--model.init_from_hf={hf_dir}"]
        cfg = load_config(argv)
        e = cfg.eval
        if not (e.path or e.mix or e.fraction):
            raise ConfigError(
                "no held-out data to evaluate on: set eval.path, [[eval.mix]] or eval.fraction "
                "in the config (or on the command line)"
            )
        p = cfg.parallel
        dims = ParallelDims.of(p, world_size_from_env())
        from trainer.evaluate.run import evaluate_weights  # torch-heavy: once the input is good

        record = evaluate_weights(cfg, dims, checkpoint)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if record is not None:  # rank 0
        print(
            " | ".join(
                f"{k} {v:.6f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
            )
        )
        if json_path:
            with open(json_path, "w") as f:
                json.dump(record, f, indent=1)
    return 0
