"""Distributed checkpoints: the whole training state, atomic, optionally async, reshardable.

Layout of `<job.output_dir>/checkpoints/`:

    step-<N>/             a complete checkpoint (only complete ones ever get this name)
        *.distcp, .metadata   model + optimizer through DCP, global (DTensor) shapes
        trainer_state.pt      step, LR schedule, data position, RNG, resolved config
        COMPLETE              written last, before the rename
    .tmp-step-<N>/        a save in progress (or one killed mid-write: ignored, removed)

Model and optimizer state are saved with their global shapes, so any layout can load
them (DCP reshards). The data position is the number of global samples consumed, which
does not depend on the layout either, so resuming on a different number of ranks neither
repeats nor skips samples.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

# NOTE: per-parameter optimizer keys ("optim.state.<fqn>.exp_avg", "optim.param_groups.<fqn>
# .lr"), not per-group ones: parameter groups differ between layouts (experts get groups of
# their own under EP), and a checkpoint must load into any layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync(path: str) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and why."""


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, in commit order (oldest first).

    NOTE: commit order, not step order: after a rollback (resume from an older step), the
    checkpoints of the abandoned future are older commits than the new ones, so
    resume=auto and keep_last follow the run that is actually going on.
    """
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        marker = os.path.join(root, name, COMPLETE)
        if match and os.path.isfile(marker):
            with open(marker) as f:
                committed = json.load(f).get("committed_at", 0.0)
            found.append((committed, int(match.group(1)), os.path.join(root, name)))
    return [(step, path) for _, step, path in sorted(found)]


def check_checkpoint(path: str) -> None:
    """Refuse a checkpoint named explicitly that is missing, incomplete or damaged."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint.resume={path!r}: no such directory")
    missing = [
        f
        for f in (COMPLETE, TRAINER_STATE, ".metadata")
        if not os.path.isfile(os.path.join(path, f))
    ]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete or damaged (missing {', '.join(missing)}); it "
            "was probably interrupted while being written. Resume from another one "
            "(checkpoint.resume=auto picks the newest complete one)"
        )


class Checkpointer:
    """Saves and restores {model, optimizer} via DCP plus the trainer's own small state."""

    def __init__(self, root: str, keep_last: int, async_save: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.async_save = async_save
        self.rank = dist.get_rank()
        # NOTE: async saves run collectives from a background thread; a group of their own
        # keeps them from interleaving with the training's collectives.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[Future, str, str, dict] | None = None

    # --- save ----------------------------------------------------------------------
    def save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, trainer_state: dict
    ) -> None:
        """Start writing step `step`; blocks only for staging when async (all ranks call)."""
        self.wait()  # one save in flight at a time
        final = os.path.join(self.root, f"step-{step}")
        tmp = os.path.join(self.root, f".tmp-step-{step}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # leftovers of saves that were killed
                if name.startswith((".tmp-step-", ".old-step-")):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_group)
            self._pending = (future, tmp, final, trainer_state)
        else:
            dcp.save(state, checkpoint_id=tmp)
            self._commit(tmp, final, trainer_state)

    def poll(self) -> None:
        """Commit a finished async save (cheap; call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed."""
        if self._pending is None:
            return
        future, tmp, final, trainer_state = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final, trainer_state)

    def _commit(self, tmp: str, final: str, trainer_state: dict) -> None:
        """Rank 0, once every rank's data is on disk (DCP's final metadata step gathers
        them): add the trainer state, mark complete, and only then rename into place."""
        if self.rank != 0:
            return
        state_path = os.path.join(tmp, TRAINER_STATE)
        torch.save(trainer_state, state_path)
        _fsync(state_path)
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            json.dump({"step": trainer_state["step"], "committed_at": time.time()}, f)
        _fsync(os.path.join(tmp, COMPLETE))
        replaced = None
        if os.path.isdir(final):  # the same step saved again: keep the old one until the swap
            replaced = os.path.join(self.root, f".old-{os.path.basename(final)}")
            os.rename(final, replaced)
        os.rename(tmp, final)  # atomic on one filesystem: a checkpoint is whole or absent
        _fsync(self.root)
        if replaced:
            shutil.rmtree(replaced, ignore_errors=True)
        if self.keep_last > 0:
            for _, old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # --- load ----------------------------------------------------------------------
    def resolve(self, resume: str) -> str | None:
        """The checkpoint to resume from: auto = the last committed complete one (or none),
        none, PATH."""
        if resume == "none":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1][1] if found else None
        check_checkpoint(resume)
        return resume

    def load(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place (any layout); returns the trainer state."""
        check_checkpoint(path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_OPTIONS,
        )
        return torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)
