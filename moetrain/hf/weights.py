"""Read and write Hugging Face checkpoint directories (config.json + safetensors).

Names and stacking are the model adapter's business (`moetrain/models/<name>/hf.py`); this file
does the file I/O and the sharding: each parameter is assembled at its full size, then
every rank keeps only its local part.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.fileio import write_atomic
from moetrain.hf.export_dir import staged_export
from moetrain.models import HFFormatError
from moetrain.models.spec import HFAdapter
from moetrain.parallelisms.sharded_init import local_index, named_weights


def _open_safetensors(path: str):
    """safe_open, with a damaged or missing file refused by name instead of a traceback."""
    try:
        return safe_open(path, "pt")
    except Exception as err:  # SafetensorError, FileNotFoundError, OSError: all mean the same
        raise HFFormatError(
            f"{path} is not a readable safetensors file ({err}); is the download complete? "
            "(model.init_from_hf)"
        ) from None


class SafetensorsDir:
    """Lazy key -> tensor view over `model.safetensors` or a sharded set with an index."""

    def __init__(self, model_dir: str) -> None:
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.key_to_file = {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not files:
                raise HFFormatError(f"no *.safetensors files in {model_dir!r} (model.init_from_hf)")
            self.key_to_file = {}
            for name in files:
                path = os.path.join(model_dir, name)
                with _open_safetensors(path) as f:
                    self.key_to_file.update(dict.fromkeys(f.keys(), path))
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def has(self, key: str) -> bool:
        return key in self.key_to_file

    def _slice(self, key: str):
        path = self.key_to_file[key]
        if path not in self._open:
            self._open[path] = _open_safetensors(path)
        return self._open[path].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def get(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `key`, or only its part `index` (read from disk without the rest)."""
        part = self._slice(key)
        try:
            tensor = part[index] if index is not None else part[:]
        except Exception as err:  # a truncated file fails only when its data is read
            raise HFFormatError(
                f"{self.key_to_file[key]}: cannot read {key!r} ({err}); is the file complete? "
                "(model.init_from_hf)"
            ) from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


@torch.no_grad()
def load_hf_weights(
    model: nn.Module, adapter: HFAdapter, args: Any, model_dir: str, whole: nn.Module | None = None
) -> SafetensorsDir:
    """Fill every parameter and buffer of `model` (sharded or not) from an HF checkpoint
    directory. `whole`: the whole model (e.g. on the meta device) when `model` is a part of
    it (this rank's pipeline stages): the file is judged against the whole.

    Each rank reads only the part of each tensor that it holds. Returns the reader (its
    `bytes_read` says how much this rank read).
    """
    reader = SafetensorsDir(model_dir)
    needed: dict[str, tuple] = {}
    for name, param in named_weights(whole if whole is not None else model):
        needed.update(adapter.hf_keys(name, tuple(param.shape), args, reader.has))
    for key, shape in needed.items():  # metadata only: refuse a mismatch before reading data
        if not reader.has(key):
            raise HFFormatError(f"{model_dir}: the checkpoint has no tensor {key!r}")
        if reader.shape(key) != shape:
            raise HFFormatError(
                f"{model_dir}: {key} has shape {reader.shape(key)} in the checkpoint but the "
                f"model expects {shape}; does config.json match the weights?"
            )
    # Judge the file against what the whole model needs, not what this rank will read.
    unused = {
        k
        for k in reader.key_to_file
        if k not in needed and not adapter.is_redundant_key(k, args, reader.has)
    }
    if unused:
        raise HFFormatError(
            f"{model_dir}: {len(unused)} checkpoint tensors do not belong to the model, e.g. "
            f"{sorted(unused)[:3]}; is this the right model family?"
        )
    for name, param in named_weights(model):
        index = local_index(param)
        part = adapter.from_hf(name, args, reader.has, reader.get, index)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(part.to(local.dtype))
    return reader


class SafetensorsWriter:
    """Writes an HF model directory shard by shard: each safetensors file as soon as it is
    full, so a writer holds at most one shard (plus the tensor being added).

    Files are written as `model-<i>.safetensors.partial` and renamed to their final names
    (`model.safetensors`, or `model-0000i-of-0000N.safetensors` with an index) on `close`.
    """

    def __init__(self, out_dir: str, config: dict, max_shard_bytes: int = 4 << 30) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.config, self.max_shard_bytes = out_dir, config, max_shard_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (partial file, its keys)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        if self._shard and self._bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[key] = tensor
        self._bytes += tensor.nbytes

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f"model-{len(self._written) + 1}.safetensors.partial")
        save_file(self._shard, path, {"format": "pt"})
        self._written.append((path, list(self._shard)))
        self._shard, self._bytes = {}, 0

    def close(self) -> None:
        if self._shard or not self._written:
            self._flush()
        n = len(self._written)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        weight_map = {}
        for (partial, keys), name in zip(self._written, names):
            os.replace(partial, os.path.join(self.out_dir, name))
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {}, "weight_map": weight_map}
            path = os.path.join(self.out_dir, "model.safetensors.index.json")
            write_atomic(path, json.dumps(index, indent=2))
        write_atomic(os.path.join(self.out_dir, "config.json"), json.dumps(self.config, indent=2))


def hf_entries(
    adapter: HFAdapter,
    name: str,
    full: torch.Tensor,
    args: Any,
    dtype: torch.dtype,
    is_buffer: bool,
) -> dict[str, torch.Tensor]:
    """The HF entries of native tensor `name` (its full value) in the export dtype.

    NOTE: buffers keep their dtype: a routing bias in bf16 would round away updates smaller
    than its spacing (transformers keeps it fp32 too).
    """
    out_dtype = full.dtype if is_buffer else dtype
    return {k: t.to(out_dtype) for k, t in adapter.to_hf(name, full.detach(), args).items()}


@torch.no_grad()
def save_hf_checkpoint(
    model: nn.Module,
    adapter: HFAdapter,
    args: Any,
    out_dir: str,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write config.json + safetensors (per-expert keys) from rank 0; all ranks must call.

    Each parameter is gathered to full size (`full_tensor`) one at a time, and rank 0 writes
    each file as soon as it is full: its memory holds one parameter and one shard.
    `out_dir` is replaced whole once written (export_dir.py).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = adapter.hf_config_dict(args, dtype)  # may refuse: before any work is done
    with staged_export(out_dir) if rank == 0 else nullcontext() as staging:
        writer = SafetensorsWriter(staging, config, max_shard_bytes) if rank == 0 else None
        buffers = {name for name, _ in model.named_buffers()}
        for name, param in named_weights(model):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if writer is not None:
                for key, tensor in hf_entries(
                    adapter, name, full, args, dtype, name in buffers
                ).items():
                    writer.add(key, tensor)
        if writer is not None:
            writer.close()
    if dist.is_initialized():
        dist.barrier()
