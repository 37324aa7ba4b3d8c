"""Distributed checkpoints: the whole training state, atomic, optionally async, reshardable.

Layout of `<job.output_dir>/checkpoints/`:

    step-<N>/             a complete checkpoint (only complete ones ever get this name)
        *.distcp, .metadata   model + optimizer through DCP, global (DTensor) shapes
        trainer_state.pt      step, LR schedule, data position, RNG, resolved config, data
                              identity (plain tensors and data: loaded with weights_only)
        COMPLETE              written last, before the rename: the commit time and the
                              sha256 of every file above, verified before a resume loads
    .tmp-step-<N>/        a save in progress (or one killed mid-write: ignored, removed)

Model and optimizer state are saved with their global shapes, so any layout can load
them (DCP reshards). The data position is the number of global samples consumed, which
does not depend on the layout either, so resuming on a different number of ranks neither
repeats nor skips samples.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from moetrain.checkpoint.checksums import gather_sums
from moetrain.checkpoint.markers import (
    COMPLETE,
    TRAINER_STATE,
    beside,
    check_checkpoint,
    complete_checkpoints,
    newest_damaged,
    read_trainer_state,
    resume_hint,
)
from moetrain.checkpoint.writes import cause_of, directory_bytes, local_state_bytes, size_text
from moetrain.data.shards import file_sha256
from moetrain.errors import CheckpointError
from moetrain.fileio import fsync_path

# NOTE: per-parameter optimizer keys ("optim.state.<fqn>.exp_avg", "optim.param_groups.<fqn>
# .lr"), not per-group ones: parameter groups differ between layouts (experts get groups of
# their own under EP), and a checkpoint must load into any layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A frozen model's (LoRA's) checkpoint without its frozen weights: they come back from where
# the run took them (model.init_from_hf, or the seed), as the trainer state records.
_TRAINED_ONLY = StateDictOptions(
    flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False
)


def _kernel_key(key: str) -> bool:
    """A flattened optimizer key naming a group's implementation, not its state."""
    return key.startswith("param_groups.") and key.rsplit(".", 1)[-1] in ("fused", "foreach")


def _options(frozen: bool) -> StateDictOptions:
    return _OPTIONS if frozen else _TRAINED_ONLY


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, options: StateDictOptions
) -> dict[str, dict]:
    """{"model": ..., "optim": ...}: what DCP saves and loads of this rank. `optimizer`
    None: this rank trains nothing (a pipeline stage whose parameters LoRA all froze), so
    it holds no optimizer state; the other ranks' keys stay theirs."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd}


class Checkpointer:
    """Saves and restores {model, optimizer} via DCP plus the trainer's own small state."""

    def __init__(
        self,
        root: str,
        keep_last: int,
        async_save: bool,
        stop_requested: Callable[[], bool] = lambda: False,
        save_frozen: bool = True,
    ) -> None:
        """`save_frozen`: whether checkpoints hold the parameters that do not train (LoRA's
        base); the trainer state says which a checkpoint did (`frozen_saved`)."""
        self.root = root
        self.save_frozen = save_frozen
        self.keep_last = keep_last
        self.async_save = async_save
        self.stop_requested = stop_requested  # SIGTERM: stop waiting for a dead peer
        self.rank = dist.get_rank()
        # NOTE: async saves run collectives from a background thread; a group of their own
        # keeps them from interleaving with the training's collectives.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[Future, str, str, dict, int] | None = None

    # --- save ----------------------------------------------------------------------
    def _write_sums(self, tmp: str) -> None:
        """This rank's data files' checksums, next to them (rank 0 merges them at commit).

        NOTE: each rank hashes only the files it wrote, in parallel, and hands them over
        through the filesystem, not a collective: an async save's ranks finish at different
        steps, and a collective there would deadlock against the training's own."""
        mine = sorted(f for f in os.listdir(tmp) if f.startswith(f"__{self.rank}_"))
        sums = {f: file_sha256(os.path.join(tmp, f)) for f in mine}
        path = os.path.join(tmp, f".sums-{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(sums, f)
        os.replace(path + ".tmp", path)

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        trainer_state: dict,
    ) -> None:
        """Start writing step `step`; blocks only for staging when async (all ranks call).
        `optimizer` None: this rank trains no parameter (see `_state`)."""
        self.wait()  # one save in flight at a time
        final = os.path.join(self.root, f"step-{step}")
        tmp = os.path.join(self.root, f".tmp-step-{step}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # leftovers of saves that were killed
                if name.startswith((".tmp-step-", ".old-step-")):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        dist.barrier()
        trainer_state = {**trainer_state, "frozen_saved": self.save_frozen}
        state = _state(model, optimizer, _options(self.save_frozen))
        needed = self._check_room(state, final)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_group)
            self._pending = (future, tmp, final, trainer_state, needed)
            return
        failure: BaseException | None = None
        try:
            dcp.save(state, checkpoint_id=tmp)
            self._write_sums(tmp)
            self._commit(tmp, final, trainer_state)
        except (Exception, CheckpointException) as err:  # a full disk, a write error
            failure = err
        # Every rank learns whether any failed (a commit fails on rank 0 alone).
        failed = torch.tensor([float(failure is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            raise self._failed(tmp, final, needed, failure)

    def _check_room(self, state: dict, final: str) -> int:
        """The bytes this save needs (all ranks agree); refused before any write if the disk
        lacks them. Two small collectives per save."""
        needed = torch.tensor([float(local_state_bytes(state))], dtype=torch.float64)
        dist.all_reduce(needed)
        found = complete_checkpoints(self.root)
        previous = directory_bytes(found[-1][1]) if found else 0
        need = int(max(needed.item(), previous))
        short = torch.tensor([0.0])
        if self.rank == 0:
            free = shutil.disk_usage(self.root).free
            short[0] = float(free < need)
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
        if short.item():
            free = shutil.disk_usage(self.root).free
            raise CheckpointError(
                f"not enough disk space for checkpoint {final}: {size_text(free)} free in "
                f"{self.root}, the save needs about {size_text(need)} (the state's size, or "
                f"the previous checkpoint's if larger); nothing was written. {self._older()}"
            )
        return need

    def _older(self) -> str:
        found = complete_checkpoints(self.root)
        older = (
            f"{found[-1][1]} is intact: a relaunch (checkpoint.resume=auto) resumes from it"
            if found
            else "there is no older checkpoint"
        )
        return (
            f"{older}. Free space, keep fewer checkpoints (checkpoint.keep_last), or move "
            "job.output_dir, then relaunch"
        )

    def _failed(
        self, tmp: str, final: str, needed: int, err: BaseException | None
    ) -> CheckpointError:
        """Remove the partial save (rank 0) and say why it failed."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = cause_of(err) if err is not None else "it failed on another rank"
        free = shutil.disk_usage(self.root).free if os.path.isdir(self.root) else 0
        return CheckpointError(
            f"could not write checkpoint {final} ({cause}); {size_text(free)} free in "
            f"{self.root}, the save needs about {size_text(needed)}. The partial save was "
            f"removed; {self._older()}"
        )

    def poll(self) -> None:
        """Commit a finished async save (cheap; call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed."""
        if self._pending is None:
            return
        future, tmp, final, trainer_state, needed = self._pending
        self._pending = None
        # NOTE: no collective here (ranks reach it at different steps): a rank that sees the
        # failure raises and exits; torchrun then stops the others.
        try:
            future.result()
            self._write_sums(tmp)
            self._commit(tmp, final, trainer_state)
        except (Exception, CheckpointException) as err:
            raise self._failed(tmp, final, needed, err) from None

    def _commit(self, tmp: str, final: str, trainer_state: dict) -> None:
        """Rank 0, once every rank's data is on disk (DCP's final metadata step gathers
        them): add the trainer state, mark complete, and only then rename into place."""
        if self.rank != 0:
            return
        state_path = os.path.join(tmp, TRAINER_STATE)
        torch.save(trainer_state, state_path)
        fsync_path(state_path)
        files = gather_sums(tmp, dist.get_world_size(), self.stop_requested)
        for name in (".metadata", TRAINER_STATE):
            files[name] = file_sha256(os.path.join(tmp, name))
        marker = {"step": trainer_state["step"], "committed_at": time.time(), "files": files}
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            json.dump(marker, f)
        fsync_path(os.path.join(tmp, COMPLETE))
        replaced = None
        if os.path.isdir(final):  # the same step saved again: keep the old one until the swap
            replaced = os.path.join(self.root, f".old-{os.path.basename(final)}")
            os.rename(final, replaced)
        os.rename(tmp, final)  # atomic on one filesystem: a checkpoint is whole or absent
        fsync_path(self.root)
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
            newest = found[-1][1] if found else None
            damaged = newest_damaged(self.root, newer_than=newest)
            if damaged is not None:  # never passed over in silence
                path, problem = damaged
                raise CheckpointError(
                    f"the newest checkpoint, {path}, is damaged: {problem}; "
                    f"{resume_hint(self.root, path)}"
                )
            return newest
        check_checkpoint(resume, self.root)
        return resume

    def verify(self, path: str, resuming: bool = True) -> None:
        """Refuse a checkpoint whose files do not match the checksums of its commit marker,
        naming the file and the checkpoint to use instead (`resuming`: with the flag that
        resumes from it; else, to read another: a stage's start, an evaluation). The files
        are shared out over the ranks; all ranks call it, and all agree."""
        expected = check_checkpoint(path, self.root).get("files")
        bad: list[str] = []
        if expected is not None:  # markers before checksums were recorded: nothing to check
            world = dist.get_world_size()
            names = sorted(expected)
            for name in names[self.rank :: world]:
                file = os.path.join(path, name)
                if not os.path.isfile(file) or file_sha256(file) != expected[name]:
                    bad.append(file)
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, bad)
        bad = sorted(f for part in everyone for f in part)
        if bad:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {bad[0]} does not match the checksum recorded "
                f"when it was saved ({len(bad)} file(s) differ); "
                f"{resume_hint(self.root, path) if resuming else beside(path)}"
            )

    def read(self, path: str, resuming: bool = True) -> dict[str, Any]:
        """The trainer state of a verified checkpoint (all ranks call): cheap, so a caller
        can refuse the checkpoint on it before `load_weights` reads the weights; `resuming`
        as in `verify`."""
        self.verify(path, resuming)
        return read_trainer_state(path)

    def load_model(self, path: str, model: nn.Module, frozen: bool = True) -> None:
        """Restore the model alone from `path` (any layout; call `read` first): what
        `python -m moetrain.evaluate` needs, without an optimizer to fill. `frozen`: whether
        the checkpoint holds the frozen parameters (else they are left as they are)."""
        model_sd = get_model_state_dict(model, options=_options(frozen))
        state = {"model": model_sd}
        dcp.load(state, checkpoint_id=path)  # reads only the keys asked for
        set_model_state_dict(model, state["model"], options=_options(frozen))

    def load_continuation(
        self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """A continuation's start (`checkpoint.init_from`, checked by `moetrain.checkpoint.continuation`):
        the model tensors `path` holds (adapters it lacks keep their fresh init) and, given
        an optimizer, the per-parameter state (Adam's moments and step), never the param
        groups, so this run's lr, betas and weight decay apply."""
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        model_sd = get_model_state_dict(model, options=options)
        state: dict[str, dict] = {
            "model": {k: v for k, v in model_sd.items() if f"model.{k}" in index}
        }
        if optimizer is not None:
            optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
            state["optim"] = {k: v for k, v in optim_sd.items() if k.startswith("state.")}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=options)
        if optimizer is not None:
            set_optimizer_state_dict(
                model, optimizer, {**optim_sd, **state["optim"]}, options=options
            )

    @staticmethod
    def load_weights(
        path: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        frozen: bool = True,
    ) -> None:
        """Restore model and optimizer in place from `path` (any layout; call `read` first);
        `frozen` as in `load_model`; `optimizer` None: the model alone (see `_state`). No
        instance state: a single process can call it without a process group."""
        options = _options(frozen)
        state = _state(model, optimizer, options)
        # NOTE: the param groups saved the kernels too ("param_groups.<fqn>.fused",
        # ".foreach"); loaded as saved they would switch this run to the saving run's
        # `train.optimizer_impl`. This run's choice stays: the state (moments, step) is the
        # same for both implementations.
        kernels = {k: v for k, v in state.get("optim", {}).items() if _kernel_key(k)}
        dcp.load(state, checkpoint_id=path)
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=options)
            return
        state["optim"].update(kernels)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
