"""A training checkpoint as a Hugging Face model directory of merged weights
(`python -m moetrain.export`, moetrain/export/cli.py).

One process, no GPU needed, streaming: DCP reads the global tensors (from the shards of any layout) a group of
parameters at a time, the model's HF adapter turns each into its per-expert keys, and each
safetensors file is written as soon as it is full. Peak memory is about one read group plus
one output shard (and the largest single parameter), never the model. A LoRA checkpoint
exports merged weights, W + alpha/r * B @ A: a plain directory (bf16 unless --dtype says
otherwise; `--adapters` writes the adapters alone for peft: moetrain/export/adapters.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from moetrain.checkpoint.markers import read_trainer_state
from moetrain.checkpoint.tokenizer_files import recorded_tokenizer, write_tokenizer
from moetrain.checkpoint.whole_model import (
    checkpoint_model,
    checkpoint_spec,
    frozen_base,
    read_model_state,
)
from moetrain.hf.export_dir import staged_export
from moetrain.hf.weights import SafetensorsWriter, hf_entries
from moetrain.models import HFFormatError
from moetrain.models.common.lora import adapted_weights, merged
from moetrain.models.spec import ModelSpec
from moetrain.parallelisms.sharded_init import named_weights


def _groups(
    weights: list[tuple[str, torch.Tensor]], budget: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of at most `budget` bytes together (a larger one alone)."""
    group, size = [], 0
    for name, meta in weights:
        nbytes = meta.numel() * meta.element_size()
        if group and size + nbytes > budget:
            yield group
            group, size = [], 0
        group.append((name, meta))
        size += nbytes
    if group:
        yield group


@torch.no_grad()
def export_checkpoint(
    path: str,
    out_dir: str,
    dtype: torch.dtype,
    max_shard_bytes: int = 4 << 30,
    tokenizer: bool = True,
) -> str | None:
    """Write checkpoint `path` as an HF directory, holding about one read group (at most
    `max_shard_bytes` of parameters, or one larger parameter) and one output shard, with
    the tokenizer its data was prepared with (`tokenizer`; moetrain/checkpoint/tokenizer_files.py).
    `out_dir` is replaced whole (see export_dir.py): no file of an earlier export remains.
    Returns the line that says which tokenizer the export carries, or why none."""
    spec, args = checkpoint_spec(path)
    if spec.hf_adapter is None:
        raise HFFormatError(f"model {spec.name!r} has no Hugging Face adapter to export with")
    config = spec.hf_adapter.hf_config_dict(args, dtype)  # may refuse: before any work
    record, line = recorded_tokenizer(path) if tokenizer else (None, None)  # so may this
    with staged_export(out_dir) as staging:  # replaces out_dir whole, once complete
        _write(path, spec, args, SafetensorsWriter(staging, config, max_shard_bytes), dtype)
        if record is not None:
            line = write_tokenizer(record, staging, path)
    return line


def _write(
    path: str, spec: ModelSpec, args: Any, writer: SafetensorsWriter, dtype: torch.dtype
) -> None:
    """Stream checkpoint `path`'s weights, merged where LoRA, through `writer`."""
    max_shard_bytes = writer.max_shard_bytes
    model = checkpoint_model(path, spec, args)  # meta: names, global shapes, dtypes
    buffers = {name for name, _ in model.named_buffers()}
    adapted, params = adapted_weights(model), dict(model.named_parameters())
    # LoRA adapters saved alone (checkpoint.save_frozen=false): the base is rebuilt whole,
    # from where the run took it; else it streams from the checkpoint.
    base = (
        None
        if read_trainer_state(path).get("frozen_saved", True)
        else frozen_base(path, spec, args)
    )
    for group in _groups(named_weights(model), max_shard_bytes):
        tensors = {name: torch.empty(m.shape, dtype=m.dtype) for name, m in group}
        saved = tensors  # what the checkpoint holds of the group
        if base is not None:  # the routers' buffers (a trained bias) are in it all the same
            saved = {name: tensors[name] for name in tensors if name in buffers}
            tensors.update({name: base[name] for name in tensors if name not in buffers})
        adapters = {
            a: torch.empty_like(params[a], device="cpu")
            for name in tensors
            if name in adapted
            for a in adapted[name][:2]
        }
        read_model_state(path, {**saved, **adapters})
        for name in tensors.keys() & adapted.keys():  # LoRA: W + alpha/r * B @ A
            a, b, scale = adapted[name]
            tensors[name] = merged(tensors[name], adapters[a], adapters[b], scale)
        for name, full in tensors.items():
            entries = hf_entries(spec.hf_adapter, name, full, args, dtype, name in buffers)
            for key, tensor in entries.items():
                writer.add(key, tensor)
        del tensors, adapters, entries  # before the next group is read
    writer.close()
