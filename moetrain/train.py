"""The training command: `torchrun --nproc_per_node=N train.py --config FILE.toml
[--section.key=value ...]` from a clone (train.py calls `main`), or `torchrun
--nproc_per_node=N -m moetrain.train ...` wherever moetrain is installed.

Bad configs and layouts are refused here, before any process group exists: exit code 2
and one message, no traceback; so is a launch into a job directory that a live run holds
(`moetrain.checkpoint.job_lock`). A run stopped by too many consecutive bad steps exits 3,
after saving a checkpoint, and so does a run whose every step was skipped: it trained
nothing (`moetrain.loop.guard`).
"""

from __future__ import annotations

import os
import sys

from moetrain.checkpoint.job_lock import JobLock
from moetrain.config import ConfigError, format_help, load_config, startup_notes
from moetrain.errors import USER_ERRORS, refuse
from moetrain.parallelisms.dims import ParallelDims, world_size_from_env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(format_help())
        return 0
    try:
        if not any(a == "--config" or a.startswith("--config=") for a in argv):
            # The defaults alone are a 30B-parameter model: never what a bare launch means.
            raise ConfigError(
                "no --config given: pass --config FILE.toml (configs/debug_qwen3_moe.toml is "
                "a CPU demo; configs/ holds the real models)"
            )
        cfg = load_config(argv)
        p = cfg.parallel
        dims = ParallelDims.of(p, world_size_from_env())
        from moetrain.loop.preflight import preflight  # torch-heavy: only once the config is good

        corpora = preflight(cfg, dims)  # the prepared data's manifests, read once
        # One live run per job directory, held by rank 0 until this process ends.
        lock = JobLock.acquire(cfg.job.output_dir) if os.environ.get("RANK", "0") == "0" else None
    except USER_ERRORS as err:
        return refuse(err)
    if os.environ.get("RANK", "0") == "0":  # once per run, as the trainer's own lines
        for note in startup_notes(cfg, dims):
            print(note, flush=True)

    import torch.distributed as dist

    from moetrain.loop.guard import NoUpdateApplied, SkipLimitReached
    from moetrain.loop.trainer import Trainer

    try:
        Trainer(cfg, dims, corpora).fit()
        # NOTE: no rank tears its process group down while a peer may still talk to it.
        dist.barrier()
    except USER_ERRORS as err:  # e.g. a data source that turns out empty
        return refuse(err)
    except (SkipLimitReached, NoUpdateApplied) as err:  # every rank decided the same
        return refuse(err, code=3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()
    return 0


def exit_now(code: int) -> None:
    """Leave with `code`, without interpreter teardown.

    NOTE: rarely (about 1 run in 50 on CPU/gloo with all-to-all traffic), a C++ thread of
    the process-group machinery aborts the process during static destruction ("terminate
    called without an active exception"), after all work is done and the group destroyed,
    turning a finished run into exit code -6. Every file this run writes is closed by now,
    and checkpoint writes were waited for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
