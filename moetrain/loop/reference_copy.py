"""`dpo.reference=copy`: full fine-tuning's DPO reference as a second, frozen copy of the
initial model, resident beside the policy and run over each step's micro-batches before
their forwards (as LoRA's adapters-off base is), without gradient and without optimizer
state. It costs the memory of a second set of parameter shards (the planner counts it:
moetrain/planner/shards.py) and a forward per micro-batch, where `stored` costs one pass
before step 1 and 16 bytes a side (moetrain/loop/stored_reference.py).

The copy is built by moetrain/build/model.py with the policy's config and plan, so it shards,
computes (dtype, FP8, compile) and routes as the policy did at its start. A fresh run or
stage copies the policy's initial shards into it before step 1; a resume loads it from the
weights the run started from, which its checkpoints record (`dpo_reference`: the source and
its content fingerprint, moetrain/checkpoint/frozen_base.py), refused when the config names
other weights or the files changed since.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.build.distributed import Place
from moetrain.build.model import build_model
from moetrain.checkpoint.frozen_base import describe, hf_fingerprint, load_base
from moetrain.checkpoint.reference_file import check_recorded, initial_model
from moetrain.checkpoint.run_state import RunState
from moetrain.config import JobConfig
from moetrain.data.batch import Batch
from moetrain.loop.batches import Batches
from moetrain.loop.preference import ModelLogps, Reference
from moetrain.models.spec import LossTerms, ModelSpec


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ReferenceCopy:
    """The frozen copy (built now, filled by `fill` once the policy holds its weights); called
    on micro-batches, their documents' sums as `Reference` gives them."""

    def __init__(self, cfg: JobConfig, spec: ModelSpec, place: Place, terms: LossTerms) -> None:
        self.spec, self.args = spec, cfg.model.args
        self.model, self.parallel = build_model(cfg, spec, place.dims, place.meshes, place.device)
        self.model.requires_grad_(False)
        self.reference = Reference(ModelLogps(self.model, terms, cfg.data.document_mask))

    def __call__(self, micro_batches: list[Batch], width: int) -> list[torch.Tensor]:
        return self.reference(micro_batches, width)

    @torch.no_grad()
    def fill(
        self,
        cfg: JobConfig,
        policy: nn.Module,
        terms: LossTerms,
        batches: Batches,
        state: RunState,
        resumed_from: str | None,
    ) -> list[str]:
        """The initial weights into the copy: the policy's shards on a fresh start, else the
        weights the resumed checkpoint records. Returns the line to say on the console."""
        if resumed_from is None:
            ours = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            theirs = dict(policy.named_parameters()) | dict(policy.named_buffers())
            for name, tensor in ours.items():  # the same plan: the same local shards
                _local(tensor).copy_(_local(theirs[name]))
            base = dict(state.base)
            if base["source"] == "hf" and base.get("fingerprint") is None:
                base["fingerprint"] = hf_fingerprint(base["path"])  # a resume checks it
            state.reference = {"kind": "copy", "initial": initial_model(cfg), "base": base}
            line = f"dpo.reference=copy: a frozen copy of the initial model ({describe(base)})"
        else:
            base = check_recorded(resumed_from, state.reference, cfg)["base"]
            load_base(base, self.model, self.spec, self.args, whole=self.parallel.whole)
            line = f"dpo.reference=copy: the initial model reloaded from {describe(base)}"
        batches.use_reference(self)
        return [line]
