"""Entry point: `torchrun --nproc_per_node=N train.py --config FILE.toml [--section.key=value ...]`.

Bad configs and layouts are refused here, before any process group exists: exit code 2
and one message, no traceback.
"""

from __future__ import annotations

import os
import sys

from models import HFFormatError
from parallelisms.mesh import LayoutError, ParallelDims, world_size_from_env
from parallelisms.plan import PlanError
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, format_help, load_config
from trainer.data import DataError

USER_ERRORS = (ConfigError, LayoutError, DataError, HFFormatError, PlanError, CheckpointError)


def _fail(err: Exception) -> int:
    if os.environ.get("RANK", "0") == "0":  # one message, not one per rank
        print(f"error: {err}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(format_help())
        return 0
    try:
        cfg = load_config(argv)
        p = cfg.parallel
        dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world_size_from_env())
        from trainer.setup import preflight  # torch-heavy: only once the config is good

        preflight(cfg, dims)
    except USER_ERRORS as err:
        return _fail(err)

    import torch.distributed as dist

    from trainer.loop import Trainer

    try:
        Trainer(cfg, dims).fit()
        # NOTE: no rank tears its process group down while a peer may still talk to it.
        dist.barrier()
    except USER_ERRORS as err:  # e.g. a data source that turns out empty
        return _fail(err)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # NOTE: exit without interpreter teardown. Rarely (about 1 run in 50 on CPU/gloo with
    # all-to-all traffic), a C++ thread of the process-group machinery aborts the process
    # during static destruction ("terminate called without an active exception"), after all
    # work is done and the group destroyed, turning a finished run into exit code -6. Every
    # file this run writes is closed by now, and checkpoint writes were waited for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
