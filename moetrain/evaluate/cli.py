"""`python -m moetrain.evaluate`: the held-out loss of saved weights, so that checkpoints can
be compared without training.

    [torchrun --nproc_per_node=N] python -m moetrain.evaluate --config X.toml \\
        (--checkpoint DIR | --hf DIR) [--json FILE] [--section.key=value ...]

--checkpoint takes a checkpoint (OUTPUT_DIR/checkpoints/step-N) or a job's output directory
(or its checkpoints/), of which the newest complete checkpoint is evaluated (a line says
which).

The config's `[eval]` data (eval.path, [[eval.mix]] or eval.fraction, with eval.samples) is
evaluated as the training run evaluates it, on the layout of `[parallel]` and the world
size: the same loss as the run logged at that step. Exit status 2 for bad input (one
message), as train.py.
"""

from __future__ import annotations

import json
import os
import sys

from moetrain.config import ConfigError, JobConfig, load_config
from moetrain.errors import USER_ERRORS, refuse
from moetrain.parallelisms.dims import (
    ParallelDims,
    pipeline_micro_batches_needed,
    world_size_from_env,
)

USAGE = (
    "usage: python -m moetrain.evaluate --config X.toml (--checkpoint DIR | --hf DIR) "
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


def check_json_path(path: str) -> None:
    """Refuse a --json file that cannot be written, before the evaluation it would record."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "is a directory"
        fix = f"give a file's path, e.g. --json {os.path.join(path, 'eval.json')}"
    elif not os.path.isdir(where):
        problem = f"cannot be written: its directory {where} does not exist"
        fix = f"create it first (mkdir -p {where}) or give another path"
    elif not os.access(where, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        problem = "cannot be written (no permission)"
        fix = "give a path in a directory you can write to"
    else:
        return
    raise ConfigError(f"--json {path} {problem}: {fix}")


def _evaluation_only(cfg: JobConfig, dims: ParallelDims) -> None:
    """Clear what only training reads, so that the shared start-up checks judge the
    evaluation: the training batch's split over ranks (evaluation reads eval.micro_batch_size)
    and where a run starts from (evaluation loads --checkpoint or --hf, never the job's own
    checkpoints or checkpoint.init_from)."""
    # A training batch any layout splits: the fewest micro-batches per rank the pipeline
    # schedule takes (one without stages). Evaluation runs its own micro-batches forward only
    # (moetrain/parallelisms/pipeline_forward.py), which no schedule constrains.
    rounds = 1
    while pipeline_micro_batches_needed(cfg.parallel.pp_schedule, dims.pp, rounds) is not None:
        rounds += 1
    cfg.train.global_batch_size = cfg.train.micro_batch_size * dims.dp_size * rounds
    cfg.checkpoint.resume = "none"
    cfg.checkpoint.init_from = None


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
        if json_path is not None:
            check_json_path(json_path)
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
        _evaluation_only(cfg, dims)
        # torch-heavy: once the input is good
        from moetrain.checkpoint.markers import find_checkpoint
        from moetrain.evaluate.run import evaluate_weights

        if checkpoint is not None:  # a job's output directory means its newest checkpoint
            checkpoint, note = find_checkpoint(checkpoint, "--checkpoint")
            if note is not None and os.environ.get("RANK", "0") == "0":
                print(note, flush=True)
        record = evaluate_weights(cfg, dims, checkpoint)
    except USER_ERRORS as err:
        return refuse(err)  # once, under torchrun too
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
