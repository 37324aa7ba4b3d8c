"""How a run begins and what its checkpoints hold: a fresh start (init or Hugging Face
weights), a resume with every piece of state (`trainer.loop.resume` judges the checkpoint),
or a new stage from another run's weights (`trainer.loop.stages`); then the saves.

`RunCheckpoints` is built with the model, the optimizer and the run's state
(`trainer.loop.run_state.RunState`): it fills the first two from a checkpoint or the init,
and the third from the checkpoint's trainer state, which it saves with the weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from models.spec import ModelSpec
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import JobConfig, resume_notes
from trainer.data.prepared import Corpora
from trainer.loop.frozen_base import check_base, load_base, recorded_base, run_base
from trainer.loop.peft import init_adapters
from trainer.loop.peft_init import load_peft_adapters
from trainer.loop.resume import accept_checkpoint
from trainer.loop.run_state import RunState
from trainer.loop.stages import Stage, resolve_stage
from trainer.loop.tokenizer_record import tokenizer_record


class RunCheckpoints:
    """The checkpoint side of a run: where it begins (`begin`), and its saves (`save`)."""

    def __init__(
        self,
        cfg: JobConfig,
        spec: ModelSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: RunState,
        whole: nn.Module | None,
        corpora: Corpora | None,
        stop_requested: Callable[[], bool],
    ) -> None:
        """`model`: this rank's shards (of its pipeline stages: `whole` is then the whole
        model, on the meta device); `optimizer`: None on a stage that trains nothing;
        `corpora`: the prepared directories preflight opened (None: opened here);
        `stop_requested`: whether SIGTERM came (a save stops waiting for a dead peer)."""
        self.cfg, self.spec, self.args = cfg, spec, cfg.model.args
        self.model, self.optimizer, self.state = model, optimizer, state
        self.whole, self.corpora = whole, corpora
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(
            os.path.join(cfg.job.output_dir, "checkpoints"),
            ck.keep_last,
            ck.async_save,
            stop_requested=stop_requested,
            save_frozen=ck.save_frozen or cfg.peft.method != "lora",
        )

    def begin(self) -> tuple[str | None, list[str]]:
        """The weights (and, resuming, the whole state) this run starts from: its own
        newest checkpoint, else checkpoint.init_from's, else the init. Returns the
        checkpoint resumed, if any, and the notes to say on the console."""
        cfg, state, notes = self.cfg, self.state, []
        # Rank 0 alone reads the files: preflight refused what would fail here, on every rank.
        state.tokenizer = tokenizer_record(cfg, self.corpora) if state.rank == 0 else None
        resume_from = self._resume_path()
        if resume_from is not None:  # every weight (and the data position) from it
            notes += self._restore(resume_from)
            if cfg.peft.init_from:
                notes.append(f"peft.init_from is not used: this job resumes its own {resume_from}")
            if cfg.checkpoint.init_from:
                notes.append(
                    f"checkpoint.init_from is not used: this job resumes its own {resume_from} "
                    "(a stage starts from it only while job.output_dir has no checkpoint)"
                )
        elif cfg.checkpoint.init_from:  # a new stage: weights from there, the rest anew
            notes += self._start_stage(resolve_stage(cfg))
        else:
            state.base = run_base(cfg, None, None)
            self._init_weights()
            if cfg.peft.init_from:  # after the fresh init, which it overwrites
                whole = self.whole or self.model
                load_peft_adapters(self.model, whole, self.spec.hf_adapter, self.args, cfg.peft)
        return resume_from, notes

    def _resume_path(self) -> str | None:
        """The checkpoint to resume from (None: a fresh run), agreed by every rank."""
        resume = self.cfg.checkpoint.resume
        resume_from = [self.checkpointer.resolve(resume) if self.state.rank == 0 else None]
        dist.broadcast_object_list(resume_from, src=0)  # every rank loads the same one
        return resume_from[0]

    def _init_weights(self) -> None:
        """The base the state's record names (under pipeline stages, judged against the
        whole model), then fresh adapters."""
        load_base(self.state.base, self.model, self.spec, self.args, whole=self.whole)
        if self.cfg.peft.method == "lora":
            init_adapters(self.model, self.cfg.train.seed)

    def save(self) -> None:
        """The weights, the optimizer and the run's state at its current step."""
        state = self.state
        self.checkpointer.save(self.model, self.optimizer, state.step, state.state_dict())

    def poll(self) -> None:
        """Commit an async save that has finished (trainer.checkpoint.checkpointer)."""
        self.checkpointer.poll()

    def wait(self) -> None:
        """Until the last save is committed."""
        self.checkpointer.wait()

    def _restore(self, path: str) -> list[str]:
        cfg, notes = self.cfg, []
        saved = self.checkpointer.read(path)
        other_data = accept_checkpoint(path, saved, cfg, self.spec, self.state.dataset)
        if other_data:
            notes.append(f"resuming on other data than {path}'s, as allowed")
        frozen = saved.get("frozen_saved", True)
        self.state.base = recorded_base(path, saved)  # passed on to this run's checkpoints
        if not frozen:  # LoRA's adapters alone: the base first, from where the run took it
            check_base(path, self.state.base, cfg)
            self._init_weights()
        self.checkpointer.load_weights(path, self.model, self.optimizer, frozen)
        self.state.load_state_dict(saved, other_data)
        return notes + resume_notes(cfg, self.state.step)  # steps it asks for, already past

    def _start_stage(self, stage: Stage) -> list[str]:
        """`checkpoint.init_from` (checked by preflight): the model tensors the checkpoint
        holds, and its optimizer moments if asked; step, data order, schedule and RNG start
        anew, from this run's config."""
        cfg = self.cfg
        self.checkpointer.verify(stage.path, resuming=False)  # checksums, on every rank
        self.state.base = run_base(cfg, stage.path, stage.state)
        if not stage.state.get("frozen_saved", True):  # adapters alone: the base as it came
            check_base(stage.path, self.state.base, cfg)
            self._init_weights()
        elif cfg.peft.method == "lora":  # adapters the checkpoint lacks start fresh
            init_adapters(self.model, cfg.train.seed)
        optimizer = self.optimizer if cfg.checkpoint.init_optimizer else None
        self.checkpointer.load_stage(stage.path, self.model, optimizer)
        return stage.notes
