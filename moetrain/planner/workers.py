"""A search's measurements spread over worker processes and this one.

A search measures each distinct trace (micro-batch, cp, checkpointing mode) and each
distinct sharding once (`shards.Measured`). They run on the meta device one op at a
time in Python, so on DeepSeek-V3's 2,048 ranks they are most of a search's time, and they
do not depend on each other. So a search hands the traces and the whole-model shardings
to a pool of processes (each on a fake process group of the same size), shards the
pipeline stages' pieces itself, then takes back, last first, the jobs no worker has
started. A job's result is plain numbers; it sits in the cache as a future until a layout
reads it (`resolved`). The results are the same wherever a job ran: the meta device and
the fake group are deterministic.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

# A worker process's own cache (its meshes and models): set by `_start`, gone with it.
_WORKER_CACHE = None

# NOTE: a worker costs a few seconds to start (torch and the models imported) and a job of
# a large model about one or two. With fewer jobs per worker than this it does not pay.
JOBS_PER_WORKER = 12


def auto_workers(jobs: int) -> int:
    """Workers for `jobs` measurements when `--workers` is not given: one core stays with
    this process, which measures too."""
    return max(0, min((os.cpu_count() or 1) - 1, jobs // JOBS_PER_WORKER))


def _start(world_size: int) -> None:
    global _WORKER_CACHE
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moetrain.planner.shards import Measured

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    _WORKER_CACHE = Measured()


def trace_job(cfg, world_size: int, mode: str, measured=None):
    """`traces.trace_layout` of a trial config; `measured`: whose meshes (None: the
    worker's)."""
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.dims import ParallelDims
    from moetrain.planner.traces import trace_layout

    dims = ParallelDims.of(cfg.parallel, world_size)
    measured = measured or _WORKER_CACHE
    spec = get_model_spec(cfg.model.name)
    return trace_layout(cfg, spec, dims, mode, measured.meshes_of(dims), measured)


def shard_job(cfg, world_size: int, measured=None):
    """The whole model's (sharded state, FSDP units) under a trial config."""
    from moetrain.models import get_model_spec
    from moetrain.parallelisms.dims import ParallelDims
    from moetrain.planner.shards import shard

    dims = ParallelDims.of(cfg.parallel, world_size)
    measured = measured or _WORKER_CACHE
    spec = get_model_spec(cfg.model.name)
    return shard(cfg, spec, dims, world_size, measured.meshes_of(dims), measured)


def search_jobs(trials: list, world_size: int, reuse) -> list[tuple]:
    """(cache, key, job, args) for every trace and whole-model sharding `trials` (configs)
    need that `reuse` (`shards.Measured`) lacks, each in the trials' order: the
    shardings first, so that what a worker still runs when this process has taken back
    the rest is a short trace. A trial whose degrees do not resolve is left to its own measurement, which
    reports it; pipeline stages are sharded in pieces (`pipeline_stages`), not here."""
    from moetrain.config import ConfigError
    from moetrain.parallelisms.dims import ParallelDims
    from moetrain.planner.shards import MODES, shard_key
    from moetrain.planner.traces import trace_key

    traces, shards = {}, {}
    for cfg in trials:
        try:
            dims = ParallelDims.of(cfg.parallel, world_size)
        except (ValueError, ConfigError):
            continue
        for mode in MODES:
            key = trace_key(cfg, dims, mode)
            if key not in reuse.traces and key not in traces:
                traces[key] = (reuse.traces, key, trace_job, (cfg, world_size, mode))
        key = repr(shard_key(cfg, dims))
        if dims.pp == 1 and key not in reuse.shards and key not in shards:
            shards[key] = (reuse.shards, key, shard_job, (cfg, world_size))
    return [*shards.values(), *traces.values()]


class SearchPool:
    """`workers` processes, each on a fake process group of `world_size` ranks."""

    def __init__(self, world_size: int, workers: int) -> None:
        # NOTE: spawn, not fork (a copy of this process would carry its threads and meta
        # models) nor forkserver (whose first start waits for the server's imports): a
        # worker starts from nothing, importing torch and the models, while this process
        # goes on measuring.
        ctx = mp.get_context("spawn")
        self.pool = ProcessPoolExecutor(workers, ctx, initializer=_start, initargs=(world_size,))
        self.jobs: list[tuple] = []

    def submit(self, jobs: list[tuple]) -> None:
        """Each (cache, key, job, args) of `jobs` (`search_jobs`) to the workers; its future
        goes into `cache[key]`."""
        for cache, key, job, args in jobs:
            cache[key] = self.pool.submit(job, *args)
            self.jobs.append((cache, key, job, args))

    def take_back(self, measured) -> int:
        """Run here, last first, the jobs no worker has started (`measured`: this process's
        `shards.Measured`, for its meshes), then wait for the rest, running here too
        any a worker left when it died (killed for memory, say); returns how many ran
        here. A job that fails here is left out of the cache, for its layout to run again
        and report."""
        taken = 0
        for cache, key, job, args in reversed(self.jobs):
            if cache[key].cancel():
                taken += self._here(cache, key, job, args, measured)
        wait([f for f in (c.get(k) for c, k, _, _ in self.jobs) if isinstance(f, Future)])
        for cache, key, job, args in self.jobs:
            f = cache.get(key)
            if isinstance(f, Future) and isinstance(f.exception(), BrokenProcessPool):
                taken += self._here(cache, key, job, args, measured)
        return taken

    @staticmethod
    def _here(cache: dict, key, job, args: tuple, measured) -> int:
        try:
            cache[key] = job(*args, measured)
        except Exception:  # noqa: BLE001 (the layout's own measurement reports it)
            del cache[key]
        return 1

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def resolved(value):
    """A cached measurement, waiting for it if a worker still runs it."""
    return value.result() if isinstance(value, Future) else value
