"""How a run begins and what its checkpoints hold: a fresh start (init or Hugging Face
weights), a resume with every piece of state (`trainer.loop.resume` judges the checkpoint),
or a new stage from another run's weights (`trainer.loop.stages`).

`RunStart` is a part of `Trainer` (trainer.loop.trainer), split off along this seam so each
file stays readable: it reads and writes the trainer's own attributes, declared below.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from models.spec import ModelSpec
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import JobConfig, config_to_dict, resume_notes
from trainer.data.prepared import Corpora
from trainer.data.sampler import GlobalBatchSampler
from trainer.loop.frozen_base import check_base, load_base, recorded_base, run_base
from trainer.loop.guard import StepGuard
from trainer.loop.peft import init_adapters
from trainer.loop.peft_init import load_peft_adapters
from trainer.loop.resume import accept_checkpoint, data_identity
from trainer.loop.stages import Stage, resolve_stage
from trainer.loop.tokenizer_record import tokenizer_record


class RunStart:
    """The checkpoint side of `Trainer`."""

    cfg: JobConfig
    spec: ModelSpec
    args: object
    device: torch.device
    rank: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    guard: StepGuard
    loader: StatefulDataLoader
    sampler: GlobalBatchSampler
    consumed_samples: int
    step: int
    notes: list[str]
    checkpointer: Checkpointer
    _stop_requested: bool
    # Where the frozen weights came from (trainer.loop.frozen_base): saved with checkpoints
    # that omit them, so every resume, evaluation and export rebuilds the same base.
    base: dict
    corpora: Corpora | None
    # The tokenizer (and chat template) the data was prepared with, for the export and
    # `trainer.generate` (trainer.loop.tokenizer_record); rank 0's, which saves the state.
    tokenizer: dict | None

    def _begin(self) -> str | None:
        """The weights (and, resuming, the whole state) this run starts from: its own
        newest checkpoint, else checkpoint.init_from's, else the init. Returns the
        checkpoint resumed, if any."""
        cfg = self.cfg
        # Rank 0 alone reads the files: preflight refused what would fail here, on every rank.
        self.tokenizer = tokenizer_record(cfg, self.corpora) if self.rank == 0 else None
        resume_from = self._resume_path()
        if resume_from is not None:  # every weight (and the data position) from it
            self._restore(resume_from)
            if cfg.peft.init_from:
                self.notes.append(
                    f"peft.init_from is not used: this job resumes its own {resume_from}"
                )
            if cfg.checkpoint.init_from:
                self.notes.append(
                    f"checkpoint.init_from is not used: this job resumes its own {resume_from} "
                    "(a stage starts from it only while job.output_dir has no checkpoint)"
                )
        elif cfg.checkpoint.init_from:  # a new stage: weights from there, the rest anew
            self._start_stage(resolve_stage(cfg))
        else:
            self.base = run_base(cfg, None, None)
            self._init_weights()
            if cfg.peft.init_from:  # after the fresh init, which it overwrites
                whole = self.parallel.whole or self.model
                load_peft_adapters(self.model, whole, self.spec.hf_adapter, self.args, cfg.peft)
        return resume_from

    def _resume_path(self) -> str | None:
        """The checkpointer, and the checkpoint to resume from (None: a fresh run)."""
        ck = self.cfg.checkpoint
        self.checkpointer = Checkpointer(
            os.path.join(self.cfg.job.output_dir, "checkpoints"),
            ck.keep_last,
            ck.async_save,
            stop_requested=lambda: self._stop_requested,
            save_frozen=ck.save_frozen or self.cfg.peft.method != "lora",
        )
        resume_from = [self.checkpointer.resolve(ck.resume) if self.rank == 0 else None]
        dist.broadcast_object_list(resume_from, src=0)  # every rank loads the same one
        return resume_from[0]

    def _init_weights(self) -> None:
        """The base `self.base` names (under pipeline stages, judged against the whole
        model), then fresh adapters."""
        load_base(self.base, self.model, self.spec, self.args, whole=self.parallel.whole)
        if self.cfg.peft.method == "lora":
            init_adapters(self.model, self.cfg.train.seed)

    def seed_step(self) -> None:
        """Seed this rank's RNG for the next step from (train.seed, step, rank).

        NOTE: training's only random draws are dropout's (LoRA's `peft.dropout`); seeding
        each step from where it stands, not from the RNG state the last step left, makes a
        resume on the same layout draw the same masks without saving every rank's state.
        """
        key = f"{self.cfg.train.seed}:{self.step + 1}:{self.rank}".encode()
        torch.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))

    def trainer_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "step": self.step,
            # The LR schedule is a function of the step and the skipped steps (the guard's).
            "guard": self.guard.state_dict(),
            # The data position at this step boundary: the same on every rank and layout.
            "data": self.sampler.state_at(self.consumed_samples),
            "rng": rng,  # rank 0's; each step seeds its own draws (seed_step)
            "config": config_to_dict(self.cfg),
            "data_identity": data_identity(self.loader.dataset),
            "base": self.base,
            "tokenizer": self.tokenizer,
        }

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.model, self.optimizer, self.step, self.trainer_state())

    def _restore(self, path: str) -> None:
        state = self.checkpointer.read(path)
        other_data = accept_checkpoint(path, state, self.cfg, self.spec, self.loader.dataset)
        if other_data:
            self.notes.append(f"resuming on other data than {path}'s, as allowed")
        frozen = state.get("frozen_saved", True)
        self.base = recorded_base(path, state)  # passed on to this run's checkpoints
        if not frozen:  # LoRA's adapters alone: the base first, from where the run took it
            check_base(path, self.base, self.cfg)
            self._init_weights()
        self.checkpointer.load_weights(path, self.model, self.optimizer, frozen)
        self.step = state["step"]
        self.notes += resume_notes(self.cfg, self.step)  # steps it asks for, already past
        if "guard" in state:  # checkpoints from before the guard skipped nothing
            self.guard.load_state_dict(state["guard"])
        if other_data:  # on purpose: continue the global sample count in the new data's order
            self.sampler.continue_on_other_data(state["data"])
        else:
            self.sampler.load_state_dict(state["data"])
        self.consumed_samples = self.sampler.consumed_samples
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def _start_stage(self, stage: Stage) -> None:
        """`checkpoint.init_from` (checked by preflight): the model tensors the checkpoint
        holds, and its optimizer moments if asked; step, data order, schedule and RNG start
        anew, from this run's config."""
        self.checkpointer.verify(stage.path, resuming=False)  # checksums, on every rank
        self.base = run_base(self.cfg, stage.path, stage.state)
        if not stage.state.get("frozen_saved", True):  # adapters alone: the base as it came
            check_base(stage.path, self.base, self.cfg)
            self._init_weights()
        elif self.cfg.peft.method == "lora":  # adapters the checkpoint lacks start fresh
            init_adapters(self.model, self.cfg.train.seed)
        optimizer = self.optimizer if self.cfg.checkpoint.init_optimizer else None
        self.checkpointer.load_stage(stage.path, self.model, optimizer)
        self.notes += stage.notes
