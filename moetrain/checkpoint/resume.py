"""Which checkpoint a run may resume from, judged on its trainer state before any weight is
read: the same model (another architecture is named key by key, not left to DCP's shape
errors), the same `data.seq_len` (another is a new stage: `moetrain.checkpoint.continuation`), a position
at a step boundary, and the same data unless `checkpoint.allow_data_change` says
otherwise."""

from __future__ import annotations

import os
from typing import Any

from moetrain.checkpoint.frozen_base import check_base, recorded_base
from moetrain.checkpoint.markers import complete_checkpoints, read_trainer_state
from moetrain.checkpoint.reference_file import check_recorded
from moetrain.config import JobConfig, config_to_dict
from moetrain.config.objective_checks import dpo_reference
from moetrain.data.holdout import HOLDOUT_HASH
from moetrain.data.packing import PackedDataset
from moetrain.errors import CheckpointError, DataError
from moetrain.models.spec import ModelSpec


def data_identity(dataset: PackedDataset) -> dict[str, Any]:
    """What a checkpoint records of the data it was trained on (`holdout`: the hash that
    picks eval.fraction's held-out documents, moetrain.data.holdout)."""
    summary = dataset.summary
    return {
        "source": summary.source,
        "tokens": summary.tokens,
        "fingerprint": summary.fingerprint,
        "holdout": HOLDOUT_HASH,
    }


def old_holdout(path: str, state: dict, cfg: JobConfig) -> bool:
    """Whether the checkpoint held documents out by the hash before HOLDOUT_HASH (its data
    identity names none): refused by name unless checkpoint.allow_data_change."""
    fraction = state.get("config", {}).get("eval", {}).get("fraction")
    saved = state.get("data_identity") or {}
    if fraction is None or not saved or saved.get("holdout") == HOLDOUT_HASH:
        return False
    if not cfg.checkpoint.allow_data_change:
        raise DataError(
            f"{path} was trained with eval.fraction={fraction} under the old hold-out hash "
            f"(a mix of d * 0x9E3779B97F4A7C15, which held out document 0 at every fraction); "
            f'this trainer holds out document d by {HOLDOUT_HASH} (docs/data.md, "Held-out '
            'documents"), so the training documents differ. Start a new job.output_dir, or '
            "pass --checkpoint.allow_data_change=true to continue on the new split on purpose"
        )
    return True


def accept_model(path: str, state: dict, cfg: JobConfig, spec: ModelSpec) -> None:
    """Refuse a checkpoint of another architecture than `cfg`'s, naming the keys."""
    saved = state.get("config", {}).get("model", {})
    ours = config_to_dict(cfg)["model"]
    ignore = {"init_from_hf", *spec.training_fields}
    differ = [
        f"model.{k}: checkpoint {saved[k]!r}, this run {ours[k]!r}"
        for k in ours
        if k in saved and k not in ignore and saved[k] != ours[k]
    ]
    if differ:
        raise CheckpointError(
            f"{path} holds another model than this run's ({'; '.join(differ[:6])}); resume "
            "with the checkpoint's model keys, or start a new job.output_dir"
        )
    # LoRA's adapters are part of the model: which modules carry them, their shapes, and
    # the scale alpha / rank they are applied with (another alpha is another function).
    saved_peft = state.get("config", {}).get("peft", {"method": "none"})
    ours_peft = config_to_dict(cfg)["peft"]
    keys = ("method",) if ours_peft["method"] == "none" else ("method", "rank", "targets", "alpha")
    differ = [
        f"peft.{k}: checkpoint {saved_peft.get(k)!r}, this run {ours_peft[k]!r}"
        for k in keys
        if saved_peft.get(k, ours_peft[k] if k != "method" else "none") != ours_peft[k]
    ]
    if differ:
        raise CheckpointError(
            f"{path} was trained with other adapters than this run's ({'; '.join(differ)}); "
            "use the checkpoint's [peft] keys"
        )


def accept_seq_len(path: str, state: dict, cfg: JobConfig) -> None:
    """A resume continues the checkpoint's sample order, which its `data.seq_len` cut: a new
    length is a new stage (`checkpoint.init_from`), not a resume."""
    saved = state.get("config", {}).get("data", {}).get("seq_len")
    if saved is not None and saved != cfg.data.seq_len:
        raise DataError(
            f"{path} was trained at data.seq_len={saved}, but this run has "
            f"data.seq_len={cfg.data.seq_len}: a resume continues the same samples, so it "
            f"keeps data.seq_len. To train on at the new length, start a new stage from it in "
            f"a new job.output_dir: --checkpoint.init_from={path} (its weights; add "
            "--checkpoint.init_optimizer=true for its optimizer state)"
        )


def accept_objective(path: str, state: dict, cfg: JobConfig) -> None:
    """A resume keeps the checkpoint's `train.objective`: its adapters were trained to it,
    and DPO's reference (the base with the adapters off) is the base the checkpoint records
    only for a run that was DPO from its start."""
    saved = state.get("config", {}).get("train", {}).get("objective", "sft")
    if saved != cfg.train.objective:
        raise DataError(
            f"{path} was trained with train.objective={saved}, but this run has "
            f"train.objective={cfg.train.objective}: a resume continues the same training. "
            f"Start a new stage in a new job.output_dir (checkpoint.init_from={path}; for DPO "
            "after a LoRA stage, its merged export as model.init_from_hf)"
        )


def resume_candidate(cfg: JobConfig) -> str | None:
    """The checkpoint a launch would resume from, as far as the files say before any
    process group exists (the trainer resolves it again, refusing a damaged newest one)."""
    resume = cfg.checkpoint.resume
    if resume != "auto":
        return None if resume == "none" else resume
    found = complete_checkpoints(os.path.join(cfg.job.output_dir, "checkpoints"))
    return found[-1][1] if found else None


def check_resume(path: str, cfg: JobConfig, spec: ModelSpec) -> None:
    """What can be refused of a resume from its trainer state alone, before work starts."""
    state = read_trainer_state(path)
    accept_model(path, state, cfg, spec)
    accept_seq_len(path, state, cfg)
    accept_objective(path, state, cfg)
    old_holdout(path, state, cfg)  # a checkpoint of the old hold-out hash: refused here
    if not state.get("frozen_saved", True):  # adapters alone: their base must be as it was
        check_base(path, recorded_base(path, state), cfg)
    if cfg.train.objective == "dpo" and dpo_reference(cfg) != "base":  # full fine-tuning's
        check_recorded(path, state.get("dpo_reference"), cfg)


def accept_checkpoint(
    path: str, state: dict, cfg: JobConfig, spec: ModelSpec, dataset: PackedDataset
) -> bool:
    """Refuse another model or `data.seq_len`, a position that is not at a step boundary,
    or other data unless allowed. Returns whether the data differs (allowed)."""
    accept_model(path, state, cfg, spec)
    accept_seq_len(path, state, cfg)
    if state["data"]["micro_batches_into_step"]:
        # The trainer saves at step boundaries only; a mid-step position would put its
        # own count of consumed samples out of step with the sampler's.
        raise DataError(f"{path}: its data position is not at a step boundary")
    if old_holdout(path, state, cfg):
        return True
    saved, ours = state.get("data_identity"), data_identity(dataset)
    if not saved or saved["fingerprint"] == ours["fingerprint"]:
        return False
    if not cfg.checkpoint.allow_data_change:
        raise DataError(
            f"{path} was trained on other data ({saved['source']}, {saved['tokens']:,} "
            f"tokens) than this run's ({ours['source']}, {ours['tokens']:,} tokens; "
            "content fingerprints differ); resume on its data, or pass "
            "--checkpoint.allow_data_change=true to continue on this data on purpose"
        )
    return True
