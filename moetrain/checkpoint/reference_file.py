"""Full fine-tuning's DPO reference in the checkpoints. `dpo.reference=stored`: the file that
keeps the initial model's reference log-probabilities (moetrain/loop/stored_reference.py
computes them) in `job.output_dir`, and the record of it that every checkpoint of the run
carries (`trainer_state.pt`'s `dpo_reference`).

Invariant: a run's reference is its initial model's, computed once before step 1 of a fresh
run (or stage); a resume reads the file its checkpoint records, verified by sha256, and
never computes it again (the weights are then the trained ones). A resume whose file is
gone or changed, whose data is not the data the file covers, or whose config names another
initial model than the one the file was computed from, is refused.

Under `dpo.reference=copy` the record names the weights the copy was loaded with instead
(`moetrain/loop/reference_copy.py`), judged by `check_initial` alike.

The file is a safetensors file of two tensors: `keys` (int64 [N], sorted: each document's
content fingerprint) and `sums` (float64 [N]: its reference log-probability sum), written
beside and renamed over (a kill mid-write leaves the old file or the new one, never half).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from moetrain.checkpoint.frozen_base import weights_problem
from moetrain.config import JobConfig
from moetrain.config.objective_checks import dpo_reference
from moetrain.data.shards import file_sha256
from moetrain.errors import CheckpointError
from moetrain.fileio import fsync_path

REFERENCE_FILE = "dpo_reference.safetensors"


def initial_model(cfg: JobConfig) -> dict[str, Any]:
    """The keys that name a run's initial weights, as its config gives them: the reference
    is that model's (a seed matters only when no weights are loaded)."""
    initial = {
        "model.init_from_hf": cfg.model.init_from_hf,
        "checkpoint.init_from": cfg.checkpoint.init_from,
    }
    if not cfg.model.init_from_hf and not cfg.checkpoint.init_from:
        initial["train.seed"] = cfg.train.seed
    return initial


def write_reference(
    output_dir: str, keys: torch.Tensor, sums: torch.Tensor, cfg: JobConfig, data: str
) -> dict[str, Any]:
    """Write the table (rank 0) and return the record a checkpoint keeps of it; `data`: the
    training data's content fingerprint (`data_identity`)."""
    path = os.path.join(output_dir, REFERENCE_FILE)
    tmp = path + ".tmp"
    os.makedirs(output_dir, exist_ok=True)
    save_file({"keys": keys.cpu().contiguous(), "sums": sums.cpu().contiguous()}, tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(output_dir)
    return {
        "kind": "stored",
        "file": REFERENCE_FILE,
        "sha256": file_sha256(path),
        "documents": int(keys.numel()),
        "data": data,
        "initial": initial_model(cfg),
    }


FRESH = "start a new job.output_dir (a fresh run computes the reference of its own start)"


def check_initial(checkpoint: str, record: dict | None, cfg: JobConfig, what: str) -> dict:
    """`record` (a resumed checkpoint's `dpo_reference`), refused when missing or when this
    config names another initial model than the one its reference `what` was taken from."""
    if record is None or record.get("kind") != dpo_reference(cfg):
        raise CheckpointError(
            f"{checkpoint} records no {what} (it was trained with another dpo.reference), and "
            f"a resume never takes the reference from trained weights; resume with the "
            f"checkpoint's dpo.reference, or {FRESH}"
        )
    differ = [
        f"{k}: {record['initial'].get(k)!r} at the start, {v!r} now"
        for k, v in initial_model(cfg).items()
        if record["initial"].get(k) != v
    ]
    if differ:
        raise CheckpointError(
            f"{checkpoint}'s {what} is of another initial model than this config names "
            f"({'; '.join(differ)}); resume with the keys the run started with, or {FRESH}"
        )
    return record


def check_recorded(checkpoint: str, record: dict | None, cfg: JobConfig) -> dict:
    """What a resume of `checkpoint` (its `dpo_reference`: `record`) under this run's
    dpo.reference=stored or copy takes its reference from, judged before any weight is read:
    of this config's initial model, and the file (stored) or the weights (copy) as they were."""
    if dpo_reference(cfg) == "stored":
        record = check_initial(checkpoint, record, cfg, "stored DPO reference")
        path = os.path.join(cfg.job.output_dir, record["file"])
        if not os.path.isfile(path) or file_sha256(path) != record["sha256"]:
            what = "is gone" if not os.path.isfile(path) else "changed since (sha256 differs)"
            raise CheckpointError(
                f"{path}, the stored DPO reference {checkpoint} was trained against, {what}; "
                f"it is not computed again from trained weights: restore the file, or {FRESH}"
            )
        return record
    record = check_initial(checkpoint, record, cfg, "reference copy's weights")
    base = record["base"]
    problem = weights_problem(base)  # as a LoRA base is judged (`check_base`)
    where = f"{checkpoint}'s DPO reference is the model at {base.get('path')} as the run started"
    if problem == "gone":
        raise CheckpointError(f"{where}, and it is gone; restore it, or {FRESH}")
    if problem == "changed":
        raise CheckpointError(
            f"{where}, but its weights changed since (their content fingerprint differs); "
            f"restore them, or {FRESH}"
        )
    return record


def read_reference(
    checkpoint: str, record: dict | None, cfg: JobConfig, data: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table the resumed `checkpoint` records (`record`), verified: its file as written,
    computed from this run's initial model and data (`data`: its content fingerprint)."""
    record = check_recorded(checkpoint, record, cfg)
    if record["data"] != data:
        raise CheckpointError(
            f"{checkpoint}'s stored DPO reference covers other data than this run's (content "
            f"fingerprints differ): the new pairs have no reference of the initial model; "
            f"resume on the run's data, or {FRESH}"
        )
    table = load_file(os.path.join(cfg.job.output_dir, record["file"]))
    return table["keys"], table["sums"]
