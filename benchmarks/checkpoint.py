"""Checkpoint save/load time and the training-step stall, async on and off.

    python benchmarks/checkpoint.py --config configs/debug_qwen3_moe.toml [--section.key=value ...]
    torchrun --nproc_per_node=N benchmarks/checkpoint.py --config ...

Per mode (sync, async): `stall_s` is how long the training loop is blocked by the save
call (all of the write when sync; staging only when async), `save_s` the time until the
checkpoint is complete on disk, `load_s` the time to restore it. Prints one JSON object
(rank 0), then a one-line summary.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.config import load_config  # noqa: E402
from moetrain.parallelisms.dims import ParallelDims, world_size_from_env  # noqa: E402


def main() -> None:
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.checkpoint.markers import complete_checkpoints
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer

    cfg = load_config(sys.argv[1:])
    cfg.train.steps, cfg.train.warmup_steps = 2, 1
    cfg.metrics.jsonl = False
    cfg.checkpoint.resume = "none"
    p = cfg.parallel
    dims = ParallelDims.of(p, world_size_from_env())
    corpora = preflight(cfg, dims)
    trainer = Trainer(cfg, dims, corpora)
    trainer.fit()  # optimizer state exists, as in a real save
    root = tempfile.mkdtemp(prefix="ckpt-bench-") if trainer.rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    result = {"config": cfg.job.name, "world_size": dims.world_size}
    for mode in ("sync", "async"):
        checkpointer = Checkpointer(os.path.join(root, mode), 0, mode == "async")
        trainer.checkpoints.checkpointer = checkpointer  # the saves of the run go here
        dist.barrier()
        start = time.perf_counter()
        trainer.checkpoints.save()
        stall = time.perf_counter() - start
        checkpointer.wait()
        dist.barrier()
        saved = time.perf_counter() - start
        path = complete_checkpoints(os.path.join(root, mode))[-1][1]
        start = time.perf_counter()
        checkpointer.read(path)
        checkpointer.load_weights(path, trainer.model, trainer.optimizer)
        dist.barrier()
        result[mode] = {"stall_s": stall, "save_s": saved, "load_s": time.perf_counter() - start}
    size = sum(f.stat().st_size for f in os.scandir(path) if f.is_file())
    result["checkpoint_mib"] = size / 2**20
    dist.barrier()
    if trainer.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result))
        s, a = result["sync"], result["async"]
        print(
            f"{cfg.job.name} checkpoint ({result['checkpoint_mib']:.1f} MiB, {dims.world_size} ranks): "
            f"sync stalls {1000 * s['stall_s']:.0f} ms, async stalls {1000 * a['stall_s']:.0f} ms "
            f"(complete after {1000 * a['save_s']:.0f} ms); load {1000 * s['load_s']:.0f} ms"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
