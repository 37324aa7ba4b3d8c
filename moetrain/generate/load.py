"""The model, tokenizer and stop tokens of a training checkpoint or a Hugging Face export.

- a checkpoint (`step-<N>`, or a job's output directory: its newest): the whole model on
  CPU (`moetrain.checkpoint.whole_model.load_checkpoint_model`, LoRA adapters saved alone included), and
  the tokenizer its data was prepared with, as the checkpoint records it, with the chat
  template the data was rendered with and its options: the files an export would carry,
  written to a temporary directory and loaded from there, so the two agree by construction;
- an export (a directory with config.json): the project's model of its `model_type`, read
  through the model's HF adapter, its tokenizer files, and generation_config.json's stop
  tokens (else the tokenizer's EOS and its template's).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moetrain.build.model import meta_model
from moetrain.checkpoint.markers import find_checkpoint, read_trainer_state
from moetrain.checkpoint.tokenizer_files import recorded_tokenizer, write_tokenizer
from moetrain.checkpoint.whole_model import load_checkpoint_model
from moetrain.data.tokenizers import ByteTokenizer
from moetrain.errors import CheckpointError
from moetrain.hf.stop_tokens import stop_ids
from moetrain.hf.weights import load_hf_weights
from moetrain.models import HFFormatError, get_model_spec, model_names, read_config_json
from moetrain.models.common.plan import ParallelPlan


@dataclass
class Tokenizer:
    tok: Any  # a transformers tokenizer, or the byte tokenizer
    stop: list[int]  # the ids that end an answer
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # prepare's template options

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))


def _eos_list(directory: str) -> list[int] | None:
    """generation_config.json's eos_token_id, as a list (None: no such file or key)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _hf_tokenizer(directory: str) -> tuple[Any, list[int]]:
    """transformers' tokenizer of `directory` and its stop tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    stop = _eos_list(directory)
    return tok, stop if stop is not None else stop_ids(tok, [tok.eos_token_id], {})


def resolve(path: str) -> tuple[str, str]:
    """("export", path) when `path` holds config.json, else ("checkpoint", the checkpoint
    it means: itself, or a job's newest). CheckpointError when it is neither."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return "export", path

    checkpoint, note = find_checkpoint(path, "--checkpoint")
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    return "checkpoint", checkpoint


def load_tokenizer(kind: str, path: str) -> Tokenizer:
    """The tokenizer of checkpoint or export `path` (before its model: refusals first)."""
    if kind == "export":
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise HFFormatError(
                f"{path} holds no tokenizer.json, so prompts cannot be tokenized; export "
                "again from a checkpoint of a run with an HF tokenizer (its export carries "
                "it), or copy the tokenizer files the model was trained with into it"
            )
        return Tokenizer(*_hf_tokenizer(path))

    record = read_trainer_state(path).get("tokenizer")
    if record is None:
        raise CheckpointError(
            f"{path} records no tokenizer (it was saved before checkpoints recorded one), so "
            "its prompts cannot be tokenized as its data was; export it (python -m "
            "moetrain.export), copy the tokenizer files into the export, and give the export"
        )
    if record["kind"] == "byte":
        return Tokenizer(ByteTokenizer(), [ByteTokenizer.eos_id])
    record, _ = recorded_tokenizer(path)  # refused if its files changed or are gone
    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer(record, directory, path)
        tok, stop = _hf_tokenizer(directory)
    return Tokenizer(tok, stop, record.get("chat_template_kwargs") or {})


def load_model(kind: str, path: str, device: torch.device) -> tuple[nn.Module, ParallelPlan]:
    """The whole model of checkpoint or export `path`, in eval mode, on `device`, and its
    parallel plan (which names the attention cores the KV cache replaces)."""
    if kind == "checkpoint":
        model, spec, _ = load_checkpoint_model(path)
        return model.to(device), spec.plan

    model_type = read_config_json(path).get("model_type")
    if model_type not in model_names():
        raise HFFormatError(
            f"{path}/config.json has model_type {model_type!r}, which this project has no "
            f"model for; it reads {', '.join(model_names())}"
        )
    spec = get_model_spec(model_type)
    args = spec.hf_adapter.load_hf_config(path)
    model = meta_model(spec, args)
    model.to_empty(device="cpu")  # every weight comes from the files
    load_hf_weights(model, spec.hf_adapter, args, path)
    return model.eval().to(device), spec.plan
