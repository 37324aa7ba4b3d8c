"""The ranks' side of the model suite's layout check (tests/test_model_layouts.py): many
families' runs on one launch of ranks, each built as train.py builds it."""

from __future__ import annotations

import gc
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.families.family import Family
from tests.parity import build_trainer

ONE_RANK = "one_rank"  # the run every layout of a family is compared with
# A collective a failed run left its peers waiting in ends the launch after this, not after
# gloo's default 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def run_key(family: Family, layout: str) -> str:
    return f"{family.name}/{layout}"


def layout_argv(family: Family, layout: str, out_dir: str) -> list[str]:
    """train.py's arguments of one run: the family's debug config, its train_argv, the
    layout's, and a job directory of its own (nothing to resume, no metrics files)."""
    extra = () if layout == ONE_RANK else family.layouts[layout].argv
    return [
        f"--config={family.debug_config}",
        *family.train_argv,
        *extra,
        f"--job.output_dir={out_dir}",
        "--metrics.jsonl=false",
        "--metrics.progress=false",
    ]


def _train(argv: list[str], world: int) -> list[tuple[int, float, float]]:
    cfg, trainer = build_trainer(argv, world)
    records = [
        trainer.steps.train_step(trainer.next_micro_batches()) for _ in range(cfg.train.steps)
    ]
    return [(int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in records]


def layout_runs_worker(rank: int, world: int, runs: list[tuple[str, list[str]]], out: str):
    """Each (key, argv) of `runs` in turn, on this launch's `world` ranks: (step, loss, grad
    norm) of each step, or the error it raised (the same on every rank for a refused config
    or a failed check; a failure of one rank alone leaves its peers in a collective, and the
    launch ends at COLLECTIVE_TIMEOUT). Rank 0 saves {key: records or error} to `out`."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)  # the Trainer's, from here
    results: dict[str, list | str] = {}
    for key, argv in runs:
        try:
            results[key] = _train(argv, world)
        except Exception:  # noqa: BLE001 - the run's own test reports it
            results[key] = traceback.format_exc()
        gc.collect()  # the run's model, optimizer and meshes before the next one's
    if rank == 0:
        torch.save(results, out)
