"""Where a run's frozen weights came from, so that a checkpoint saved without them (LoRA with
`checkpoint.save_frozen=false`) is rebuilt on the same weights by every resume, evaluation,
stage and export, and refused when those weights changed.

Invariant: a checkpoint's `base` record names the weights its frozen tensors held when the
run started, by source and content fingerprint, the way `data_identity` names its data:

- `{"source": "hf", "path": DIR, "fingerprint": F}`: `model.init_from_hf`;
- `{"source": "checkpoint", "path": STEP_DIR, "fingerprint": F}`: a stage's
  `checkpoint.init_from` that holds its frozen tensors (a checkpoint of adapters alone
  passes its own record on, so a chain of stages ends at weights that exist);
- `{"source": "seed", "seed": N}`: the init from `train.seed` (no file to fingerprint).

Fingerprints (docs/finetuning.md, "LoRA"): a checkpoint's is the digest of the checksums its
commit marker lists (every byte, already hashed at save); a Hugging Face directory's covers
each `*.safetensors` file's name and size, and its bytes: whole up to `WHOLE_FILE_BYTES`, above
that its header and `SAMPLES` blocks spread evenly over it, so that a multi-GB base is not
read through on every start. A base replaced at the same path by other weights changes
every tensor and is caught; an edit of a few bytes in a large file may fall between samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from moetrain.checkpoint.markers import find_checkpoint, read_marker, read_trainer_state
from moetrain.config import JobConfig
from moetrain.errors import CheckpointError
from moetrain.models.spec import ModelSpec
from moetrain.parallelisms.sharded_init import init_weights_global

WHOLE_FILE_BYTES = 256 << 20
SAMPLES = 64
SAMPLE_BYTES = 64 << 10


def _safetensors_digest(path: str, digest: hashlib._Hash) -> None:
    size = os.path.getsize(path)
    digest.update(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            while block := f.read(8 << 20):
                digest.update(block)
            return
        (header,) = struct.unpack("<Q", f.read(8))  # the JSON header: names, shapes, offsets
        digest.update(f.read(header))
        for i in range(SAMPLES):
            f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))


def hf_fingerprint(model_dir: str) -> str:
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    digest = hashlib.sha256()
    for name in files:
        _safetensors_digest(os.path.join(model_dir, name), digest)
    return digest.hexdigest()


def checkpoint_fingerprint(path: str) -> str:
    files = read_marker(path).get("files") or {}
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def fingerprint(record: dict[str, Any]) -> str | None:
    """The current fingerprint of the weights `record` names (None for the seed)."""
    if record["source"] == "hf":
        return hf_fingerprint(record["path"])
    if record["source"] == "checkpoint":
        return checkpoint_fingerprint(record["path"])
    return None


def recorded_base(path: str, state: dict[str, Any]) -> dict[str, Any]:
    """The base record of checkpoint `path` (trainer state `state`). Checkpoints from before
    the record existed say it through their config: their `checkpoint.init_from` (resolved
    now: a job directory's newest complete checkpoint), or their `model.init_from_hf`, or
    their seed, with no fingerprint to check."""
    if "base" in state:
        return state["base"]
    config = state.get("config", {})
    hf_dir = config.get("model", {}).get("init_from_hf")
    stage = config.get("checkpoint", {}).get("init_from")
    if stage:
        stage_path, _ = find_checkpoint(stage, f"{path}'s checkpoint.init_from")
        return {"source": "checkpoint", "path": stage_path, "fingerprint": None}
    if hf_dir:
        return {"source": "hf", "path": hf_dir, "fingerprint": None}
    return {"source": "seed", "seed": config.get("train", {}).get("seed")}


def run_base(cfg: JobConfig, stage_path: str | None, stage_state: dict | None) -> dict:
    """The record of this run's frozen weights at its start: a stage's checkpoint (or, when
    that holds adapters alone, the base it records), else `model.init_from_hf`, else the
    seed."""
    if stage_path is not None:
        assert stage_state is not None
        if not stage_state.get("frozen_saved", True):
            return recorded_base(stage_path, stage_state)
        return {
            "source": "checkpoint",
            "path": stage_path,
            "fingerprint": checkpoint_fingerprint(stage_path),
        }
    if cfg.model.init_from_hf:
        hf_dir = cfg.model.init_from_hf
        # NOTE: only checkpoints that omit the frozen weights are ever rebuilt from this
        # record: other runs do not read their base's files a second time to fingerprint it.
        omitted = cfg.peft.method == "lora" and not cfg.checkpoint.save_frozen
        return {
            "source": "hf",
            "path": hf_dir,
            "fingerprint": hf_fingerprint(hf_dir) if omitted else None,
        }
    return {"source": "seed", "seed": cfg.train.seed}


def describe(record: dict[str, Any]) -> str:
    if record["source"] == "hf":
        return f"model.init_from_hf={record['path']}"
    if record["source"] == "checkpoint":
        return f"checkpoint.init_from={record['path']}"
    return f"train.seed={record['seed']}"


def check_base(path: str, record: dict[str, Any], cfg: JobConfig | None = None) -> None:
    """Refuse to rebuild the base of adapters-only checkpoint `path` when the weights its
    `record` names are gone or changed, or (given this run's `cfg`) when this run names
    another base of the same kind."""
    what = (
        f"{path} holds LoRA adapters alone (checkpoint.save_frozen=false), trained on the "
        f"base from {describe(record)}"
    )
    keep = (
        "; resume on the base it was trained on, or train with checkpoint.save_frozen=true so "
        "that checkpoints keep their base"
    )
    if cfg is not None:
        ours = {"hf": cfg.model.init_from_hf, "seed": cfg.train.seed}
        if record["source"] == "hf" and ours["hf"] != record["path"]:
            raise CheckpointError(f"{what}; this run has model.init_from_hf={ours['hf']}{keep}")
        if record["source"] == "seed" and (ours["hf"] or ours["seed"] != record["seed"]):
            mine = (
                f"model.init_from_hf={ours['hf']}" if ours["hf"] else f"train.seed={ours['seed']}"
            )
            raise CheckpointError(f"{what}; this run has {mine}: resume with {describe(record)}")
    problem = weights_problem(record)
    if problem == "gone":
        raise CheckpointError(f"{what}, and {record['path']} is gone{keep}")
    if problem == "changed":
        raise CheckpointError(
            f"{what}, but the weights at {record['path']} changed since (their content "
            f"fingerprint differs): the adapters would apply to another model{keep}"
        )


def weights_problem(record: dict[str, Any]) -> str | None:
    """Whether the weights `record` names are not as it recorded them: "gone" (their path),
    "changed" (their content fingerprint, where recorded), else None (the seed: always)."""
    if record["source"] == "seed":
        return None
    if not os.path.isdir(record["path"]):
        return "gone"
    if record.get("fingerprint") is not None and fingerprint(record) != record["fingerprint"]:
        return "changed"
    return None


def load_base(
    record: dict[str, Any], model: nn.Module, spec: ModelSpec, args: Any, whole: nn.Module | None
) -> None:
    """Fill `model` (sharded, or whole on CPU without a process group) with the weights
    `record` names. `whole`: the whole model when `model` is this rank's pipeline stages."""
    if record["source"] == "seed":
        init_weights_global(model, record["seed"])
        return
    if record["source"] == "hf":
        from moetrain.hf.weights import load_hf_weights  # transformers-free, but heavy

        load_hf_weights(model, spec.hf_adapter, args, record["path"], whole=whole)
        return
    path = record["path"]
    state = read_trainer_state(path)
    if not state.get("frozen_saved", True):  # adapters alone there too: their base first
        load_base(recorded_base(path, state), model, spec, args, whole)
    load_present(path, model)


def load_present(path: str, model: nn.Module) -> None:
    """The model tensors checkpoint `path` holds, into `model` (any layout); the rest keep
    their values."""
    options = StateDictOptions(strict=False)
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_sd = get_model_state_dict(model, options=options)
    state = {"model": {k: v for k, v in model_sd.items() if f"model.{k}" in index}}
    planner = DefaultLoadPlanner(allow_partial_load=True)
    dcp.load(state, checkpoint_id=path, planner=planner, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"], options=options)
