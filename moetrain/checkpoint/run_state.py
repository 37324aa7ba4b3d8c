"""What a run holds and saves besides the weights: the step, the global samples consumed,
the bad-step guard's history, the sampler's position, the RNG, and the records a resume
judges (the config, the data's identity, the frozen base, the tokenizer, full fine-tuning's
DPO reference).

`RunState.state_dict` is the content of a checkpoint's `trainer_state.pt` (what
`moetrain.checkpoint.resume` judges and `moetrain.checkpoint.continuation` reads), so its keys are the
checkpoint format: checkpoints of earlier versions resume through `load_state_dict`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from moetrain.checkpoint.resume import data_identity
from moetrain.config import JobConfig, config_to_dict
from moetrain.data.sampler import SampleOrder


@dataclass
class RunState:
    """The run's own state; the trainer, its step and its checkpoints share this one object.

    `cfg` and the order's dataset are saved as records (`config`, `data_identity`) that a resume
    judges against its own; they are read at each save, as the run holds them then.
    """

    cfg: JobConfig
    order: SampleOrder  # the samples and the order they are drawn in (moetrain.data.sampler)
    guard: Stateful  # the bad-step guard (moetrain.loop.guard.StepGuard): its window and counts
    device: torch.device  # whose RNG state is saved with rank 0's CPU one
    rank: int
    step: int = 0
    consumed_samples: int = 0  # global samples of all completed steps
    # Where the frozen weights came from (moetrain.checkpoint.frozen_base): saved with checkpoints
    # that omit them, so every resume, evaluation and export rebuilds the same base.
    base: dict | None = None
    # The tokenizer (and chat template) the data was prepared with, for the export and
    # `moetrain.generate` (moetrain.checkpoint.tokenizer_record); rank 0's, which saves the state.
    tokenizer: dict | None = None
    # dpo.reference=stored: the file of the initial model's reference log-probabilities, or
    # copy: the weights the frozen copy was loaded with (moetrain.checkpoint.reference_file);
    # what every resume takes the reference from again, never from the trained weights.
    reference: dict | None = None

    def seed_step(self) -> None:
        """Seed this rank's RNG for the next step from (train.seed, step, rank).

        NOTE: training's only random draws are dropout's (LoRA's `peft.dropout`); seeding
        each step from where it stands, not from the RNG state the last step left, makes a
        resume on the same layout draw the same masks without saving every rank's state.
        """
        key = f"{self.cfg.train.seed}:{self.step + 1}:{self.rank}".encode()
        torch.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))

    def state_dict(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "step": self.step,
            # The LR schedule is a function of the step and the skipped steps (the guard's).
            "guard": self.guard.state_dict(),
            # The data position at this step boundary: the same on every rank and layout.
            "data": self.order.sampler.state_at(self.consumed_samples),
            "rng": rng,  # rank 0's; each step seeds its own draws (seed_step)
            "config": config_to_dict(self.cfg),
            "data_identity": data_identity(self.order.dataset),
            "base": self.base,
            "tokenizer": self.tokenizer,
            "dpo_reference": self.reference,
        }

    def load_state_dict(self, state: dict[str, Any], other_data: bool = False) -> None:
        """The position of a checkpoint's `state` (already judged: moetrain.checkpoint.resume);
        `other_data`: continue its global sample count in this run's data order (allowed by
        `checkpoint.allow_data_change`). The records (`base`) are the caller's to judge."""
        self.step = state["step"]
        if "guard" in state:  # checkpoints from before the guard skipped nothing
            self.guard.load_state_dict(state["guard"])
        if other_data:  # on purpose: continue the global sample count in the new data's order
            self.order.sampler.continue_on_other_data(state["data"])
        else:
            self.order.sampler.load_state_dict(state["data"])
        self.consumed_samples = self.order.sampler.consumed_samples
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
