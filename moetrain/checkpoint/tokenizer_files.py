"""The tokenizer an export carries: the one the run's data was prepared with, as its
checkpoint records it (`moetrain.checkpoint.tokenizer_record`), so the export can be chatted with
and served as it was trained.

Written beside the weights, as transformers 5's `save_pretrained` writes a tokenizer:
- `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and
  `chat_template.jinja`, those the tokenizer directory held, copied as they were, each
  checked against the sha256 recorded when the run started: a tokenizer changed or gone
  since is refused before any work (its ids would not be the trained ones);
- for chat data, the template the data was rendered with (`--chat-template FILE`
  included), as `chat_template.jinja`, its copy in `tokenizer_config.json` removed (the
  file wins when transformers loads, and two copies could disagree);
- `generation_config.json`, whose `eos_token_id` lists the tokenizer's EOS, the data's EOS
  and the template's stop tokens (`moetrain.hf.stop_tokens`), so `generate` stops where the
  model learnt to.

A run on the byte tokenizer has no Hugging Face tokenizer: the export says so in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from moetrain.checkpoint.markers import read_trainer_state
from moetrain.data.shards import file_sha256
from moetrain.models import HFFormatError

TEMPLATE_FILE = "chat_template.jinja"


def _source(record: dict[str, Any], name: str) -> str:
    """Where recorded file `name` lies (the tokenizer.json may have another name)."""
    if name == "tokenizer.json":
        return record["tokenizer_file"]
    return os.path.join(record["directory"], name)


def _changed(record: dict[str, Any], name: str, path: str, checkpoint: str) -> HFFormatError:
    problem = "is gone" if not os.path.isfile(path) else "has changed since the run started"
    return HFFormatError(
        f"{path} {problem}: {checkpoint} was trained on data prepared with the tokenizer in "
        f"{record['directory']} (its {name} of sha256 {record['files'][name]}), which the "
        "export carries; put that tokenizer back as it was, or export with the tokenizer "
        "left out (--no-tokenizer) and add the right one by hand"
    )


def recorded_tokenizer(checkpoint: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the tokenizer record to export, None) or (None, the one line saying why there is
    none). HFFormatError when the recorded files changed or are gone."""
    record = read_trainer_state(checkpoint).get("tokenizer")
    if record is None:
        return None, (
            f"no tokenizer exported: {checkpoint} records none (it was saved before checkpoints "
            "recorded their tokenizer); copy the tokenizer files the data was prepared with "
            "into the export by hand"
        )
    if record["kind"] == "byte":
        return None, (
            "no Hugging Face tokenizer to export: the run trained on the byte tokenizer "
            "(data.tokenizer=byte; ids 0-255 are UTF-8 bytes, 256 is EOS)"
        )
    for name, digest in record["files"].items():
        path = _source(record, name)
        if not os.path.isfile(path) or file_sha256(path) != digest:
            raise _changed(record, name, path, checkpoint)
    return record, None


def write_tokenizer(record: dict[str, Any], out_dir: str, checkpoint: str) -> str:
    """Write the tokenizer files and generation_config.json of `record` into `out_dir`;
    returns the line that says what was written."""
    for name in record["files"]:
        target = os.path.join(out_dir, name)
        shutil.copyfile(_source(record, name), target)
        if file_sha256(target) != record["files"][name]:  # changed while it was copied
            raise _changed(record, name, _source(record, name), checkpoint)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    template = record.get("chat_template")
    if template is not None:  # the one the data was rendered with, as transformers 5 saves it
        with open(os.path.join(out_dir, TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(template)
        config.pop("chat_template", None)
    if "tokenizer_class" not in config:  # a bare tokenizer.json: transformers needs a class
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return _write_generation_config(record, out_dir)


def _write_generation_config(record: dict[str, Any], out_dir: str) -> str:
    """generation_config.json from the tokenizer just written (loading it is also the proof
    that transformers reads it)."""
    from transformers import AutoTokenizer, GenerationConfig

    from moetrain.hf.stop_tokens import stop_ids

    tok = AutoTokenizer.from_pretrained(out_dir)
    if record.get("eos_id") is not None and tok.eos_token is None:
        tok.eos_token = tok.convert_ids_to_tokens(record["eos_id"])  # for a bare tokenizer.json
    kwargs = record.get("chat_template_kwargs") or {}
    eos = stop_ids(tok, [tok.eos_token_id, record.get("eos_id")], kwargs)
    GenerationConfig(
        eos_token_id=eos, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out_dir)
    named = ", ".join(f"{tok.convert_ids_to_tokens(i)} ({i})" for i in eos)
    template = record.get("chat_template_origin")
    said = f"with the chat template of {template}" if template else "without a chat template"
    if template and kwargs:
        said += f" (rendered with {json.dumps(kwargs)}: pass them to apply_chat_template)"
    if record.get("note"):
        said += f" ({record['note']})"
    return f"tokenizer of {record['directory']} {said}; generation stops on {named}"
