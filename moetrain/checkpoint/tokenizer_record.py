"""What a checkpoint records of the tokenizer its data was prepared with (`trainer_state`'s
"tokenizer"), so that an export carries it and `python -m moetrain.generate` renders with it.

    {"kind": "byte"}                                     the byte tokenizer: no HF files
    {"kind": "tokenizer.json",
     "directory": ABS,                 where data.tokenizer's tokenizer.json lies
     "tokenizer_file": ABS,            the tokenizer.json data.tokenizer names
     "files": {NAME: SHA256},          tokenizer.json, tokenizer_config.json,
                                       special_tokens_map.json, chat_template.jinja:
                                       those present
     "eos_id": INT,                    the EOS the data was packed with
     "chat_template": TEXT | None,     the template the chat (and preference) corpora were
                                       rendered with
     "chat_template_origin": STR,      where it was read (a --chat-template file, or the
                                       prepare tokenizer's chat_template.jinja or config)
     "chat_template_kwargs": {...},    prepare's --chat-template-kwargs
     "note": STR | None}               why there is no template, when the data is chat

The template's text is kept in the checkpoint, not its path: the file may change or go
later, and the export must carry the template the data was rendered with. It is found from
the manifest's repeat command (`--chat-template FILE`, else the `--tokenizer` directory, the
way transformers loads it) and checked against the manifest's `chat_template_sha256`: a
template changed since the data was prepared is refused before the run starts (preflight),
since no export of it could say how the model was trained.

NOTE: reads a few small files (and hashes the tokenizer.json, a few MB): called by preflight
on every rank, before any process group, so that a refusal is every rank's, and by rank 0
for its checkpoints' state.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from typing import Any

from moetrain.config import JobConfig
from moetrain.data.prepared import Corpora
from moetrain.data.shards import Manifest, file_sha256
from moetrain.errors import DataError

# The tokenizer files an export copies (transformers 5 writes no special_tokens_map.json,
# older versions and many published models do; chat_template.jinja: transformers 5's place
# for the template, replaced in the export by the one the data was rendered with).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _option(command: str, flag: str) -> str | None:
    """The value of `flag` in a manifest's repeat command (None: absent)."""
    words = shlex.split(command)
    for i, word in enumerate(words[:-1]):
        if word == flag:
            return words[i + 1]
    return None


def _tokenizer_template(tokenizer: str) -> tuple[str | None, str]:
    """The chat template transformers loads from tokenizer path `tokenizer` (a directory or
    its tokenizer.json): chat_template.jinja first, else tokenizer_config.json's text."""
    directory = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), jinja
    config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        # A list of named templates: not one text an export could write as it was used.
        return (template if isinstance(template, str) else None), config
    return None, directory


def used_template(manifest: Manifest, where: str) -> tuple[str, str]:
    """(text, origin) of the template `manifest`'s chat corpus was rendered with, checked
    against its chat_template_sha256; DataError naming the file and the fix otherwise."""
    given = _option(manifest.command, "--chat-template")
    if given is not None:
        origin = f"--chat-template {given}"
        try:
            with open(given, encoding="utf-8") as f:
                text: str | None = f.read()
        except OSError as err:
            raise DataError(
                f"{where} was rendered with {origin}, which cannot be read now ({err.strerror}); "
                "a checkpoint records the template its data was rendered with, for the export: "
                "put the file back, or prepare the data again"
            ) from None
    else:
        tokenizer = _option(manifest.command, "--tokenizer") or ""
        text, origin = _tokenizer_template(tokenizer)
        if text is None:
            raise DataError(
                f"{where} was rendered with the chat template of --tokenizer {tokenizer}, which "
                f"has none now ({origin}); a checkpoint records the template its data was "
                "rendered with, for the export: restore it, or prepare the data again"
            )
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != manifest.source.get("chat_template_sha256"):
        raise DataError(
            f"{where} was rendered with a chat template of sha256 "
            f"{manifest.source.get('chat_template_sha256')}, but {origin} now holds another "
            f"(sha256 {digest}): the run's export would carry a template the model was not "
            "trained with; restore the file as it was, or prepare the data again with it"
        )
    return text, origin


def _chat_template(cfg: JobConfig, corpora: Corpora) -> dict[str, Any]:
    """The template fields of the record, from the training corpora's manifests."""
    paths = [t.path for t in cfg.data.mix] or [cfg.data.path]
    # Preference pairs are rendered as chat renders a last answer: the same template record.
    rendered = ("chat", "preference")
    chat = [corpora[p] for p in paths if corpora[p].manifest.source.get("format") in rendered]
    none = {"chat_template": None, "chat_template_origin": None, "chat_template_kwargs": {}}
    if not chat:
        return {**none, "note": None}
    ways = {
        (
            c.manifest.source.get("chat_template_sha256"),
            json.dumps(c.manifest.source.get("chat_template_kwargs", {}), sort_keys=True),
        )
        for c in chat
    }
    if len(ways) > 1:  # an export holds one template: none is more honest than a wrong one
        note = (
            f"the training corpora were rendered with {len(ways)} different chat templates or "
            "options; an export can carry one, so it carries none"
        )
        return {**none, "note": note}
    first = chat[0]
    text, origin = used_template(first.manifest, f"{first.key}: {first.path}")
    kwargs = first.manifest.source.get("chat_template_kwargs", {})
    return {
        "chat_template": text,
        "chat_template_origin": origin,
        "chat_template_kwargs": kwargs,
        "note": None,
    }


def tokenizer_record(cfg: JobConfig, corpora: Corpora | None = None) -> dict[str, Any]:
    """The record described in the module's docstring, for `cfg`'s run (DataError when the
    chat template the data was rendered with is gone or changed)."""
    if cfg.data.tokenizer == "byte":
        return {"kind": "byte"}
    path = os.path.abspath(os.path.expanduser(cfg.data.tokenizer))
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    files = {
        name: file_sha256(os.path.join(directory, name))
        for name in TOKENIZER_FILES
        if os.path.isfile(os.path.join(directory, name))
    }
    if not os.path.isdir(path):  # a tokenizer.json of another name: the file given
        files["tokenizer.json"] = file_sha256(path)
    record: dict[str, Any] = {
        "kind": "tokenizer.json",
        "directory": directory,
        "tokenizer_file": path if not os.path.isdir(path) else os.path.join(path, "tokenizer.json"),
        "files": files,
        "eos_id": None,
    }
    if cfg.data.source == "tokens":
        corpora = corpora or Corpora(cfg.data, None)
        first = corpora[cfg.data.mix[0].path if cfg.data.mix else cfg.data.path]
        record["eos_id"] = first.manifest.tokenizer.eos_id
        return {**record, **_chat_template(cfg, corpora)}
    none = {"chat_template": None, "chat_template_origin": None, "chat_template_kwargs": {}}
    return {**record, **none, "note": None}
