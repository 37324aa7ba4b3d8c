"""How a run begins and what its checkpoints hold: a fresh start (init or Hugging Face
weights), a resume with every piece of state (`moetrain.checkpoint.resume` judges the checkpoint),
or a continuation from another run's weights (`moetrain.checkpoint.continuation`); then the saves.

`RunCheckpoints` is built with the model, the optimizer and the run's state
(`moetrain.checkpoint.run_state.RunState`): it fills the first two from a checkpoint or the init,
and the third from the checkpoint's trainer state, which it saves with the weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

from moetrain.build.lora import init_adapters
from moetrain.build.model import TrainedModel
from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.continuation import Continuation, resolve_continuation
from moetrain.checkpoint.frozen_base import check_base, load_base, recorded_base, run_base
from moetrain.checkpoint.initial_adapters import load_peft_adapters
from moetrain.checkpoint.resume import accept_checkpoint
from moetrain.checkpoint.run_state import RunState
from moetrain.checkpoint.tokenizer_record import tokenizer_record
from moetrain.config import JobConfig, moment_dtype_notes, resume_notes
from moetrain.data.prepared import Corpora
from moetrain.models.spec import ModelSpec


class RunCheckpoints:
    """The checkpoint side of a run: where it begins (`begin`), and its saves (`save`)."""

    def __init__(
        self,
        cfg: JobConfig,
        spec: ModelSpec,
        trained: TrainedModel,
        state: RunState,
        corpora: Corpora | None,
        stop_requested: Callable[[], bool],
    ) -> None:
        """`trained`: what this rank trains and saves; `corpora`: the prepared directories
        preflight opened (None: opened here); `stop_requested`: whether SIGTERM came (a save
        stops waiting for a dead peer)."""
        self.cfg, self.spec, self.args = cfg, spec, cfg.model.args
        self.model, self.optimizer, self.whole = trained.model, trained.optimizer, trained.whole
        self.state, self.corpora = state, corpora
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
                    "(a continuation starts from it only while job.output_dir has no checkpoint)"
                )
        elif cfg.checkpoint.init_from:  # a continuation: weights from there, the rest anew
            notes += self._start_continuation(resolve_continuation(cfg))
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
        """Commit an async save that has finished (moetrain.checkpoint.checkpointer)."""
        self.checkpointer.poll()

    def wait(self) -> None:
        """Until the last save is committed."""
        self.checkpointer.wait()

    def _restore(self, path: str) -> list[str]:
        cfg, notes = self.cfg, []
        saved = self.checkpointer.read(path)
        other_data = accept_checkpoint(path, saved, cfg, self.spec, self.state.order.dataset)
        if other_data:
            notes.append(f"resuming on other data than {path}'s, as allowed")
        frozen = saved.get("frozen_saved", True)
        self.state.base = recorded_base(path, saved)  # passed on to this run's checkpoints
        self.state.reference = saved.get("dpo_reference")  # judged by whoever reads it
        if not frozen:  # LoRA's adapters alone: the base first, from where the run took it
            check_base(path, self.state.base, cfg)
            self._init_weights()
        self.checkpointer.load_weights(path, self.model, self.optimizer, frozen)
        self.state.load_state_dict(saved, other_data)
        notes += moment_dtype_notes(cfg, saved.get("config"), path)
        return notes + resume_notes(cfg, self.state.step)  # steps it asks for, already past

    def _start_continuation(self, continuation: Continuation) -> list[str]:
        """`checkpoint.init_from` (checked by preflight): the model tensors the checkpoint
        holds, and its optimizer moments if asked; step, data order, schedule and RNG start
        anew, from this run's config."""
        cfg = self.cfg
        self.checkpointer.verify(continuation.path, resuming=False)  # checksums, on every rank
        self.state.base = run_base(cfg, continuation.path, continuation.state)
        if not continuation.state.get("frozen_saved", True):  # adapters alone: the base as it came
            check_base(continuation.path, self.state.base, cfg)
            self._init_weights()
        elif cfg.peft.method == "lora":  # adapters the checkpoint lacks start fresh
            init_adapters(self.model, cfg.train.seed)
        optimizer = self.optimizer if cfg.checkpoint.init_optimizer else None
        self.checkpointer.load_continuation(continuation.path, self.model, optimizer)
        if optimizer is not None:
            saved = continuation.state.get("config")
            return continuation.notes + moment_dtype_notes(cfg, saved, continuation.path)
        return continuation.notes
