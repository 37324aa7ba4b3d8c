"""A LoRA checkpoint's adapters in the format Hugging Face `peft` loads
(`python -m moetrain.export --adapters`): `adapter_model.safetensors` and
`adapter_config.json`, to put on the base model with `PeftModel.from_pretrained`. The
adapters keep the dtype they were trained in, which the checkpoint holds (fp32), as peft's
save_pretrained keeps them, unless `--dtype` says otherwise.

Linear layers' adapters are peft `target_modules`, the routed experts' are
`target_parameters` on transformers' stacked expert parameters, each expert with its own
update as here (the map, both ways: `moetrain.hf.peft_format`). A weight whose Hugging Face
form rearranges ours is refused with the fix (its adapter would need the same), and so is a
peft too old for `target_parameters` when the experts have adapters.

The directory is replaced whole (export_dir.py): no merged weights of an earlier export stay
beside the adapters for transformers to load instead of the base.
"""

from __future__ import annotations

import functools
import json
import os

import torch
from safetensors.torch import save_file

from moetrain.checkpoint.markers import read_trainer_state
from moetrain.checkpoint.tokenizer_files import recorded_tokenizer, write_tokenizer
from moetrain.checkpoint.whole_model import (
    checkpoint_model,
    checkpoint_spec,
    read_model_state,
    saved_dtypes,
)
from moetrain.hf.export_dir import staged_export
from moetrain.hf.peft_format import (
    CONFIG,
    PREFIX,
    WEIGHTS,
    adapter_config,
    check_peft_version,
    peft_layout,
)
from moetrain.models import HFFormatError


@torch.no_grad()
def export_adapters(
    path: str, out_dir: str, dtype: torch.dtype | None = None, tokenizer: bool = True
) -> tuple[str | None, torch.dtype]:
    """Write checkpoint `path`'s adapters into `out_dir` in `dtype` (None: the dtype they
    were trained in, which the checkpoint holds them in, as peft's save_pretrained keeps
    them), with the tokenizer its data was prepared with (`tokenizer`). Returns the line
    that says which tokenizer, or why none, and the dtype written."""
    spec, args = checkpoint_spec(path)
    config = read_trainer_state(path)["config"]
    peft = config.get("peft", {})
    if peft.get("method", "none") != "lora":
        raise HFFormatError(f"{path} holds no LoRA adapters (peft.method=none): nothing to export")
    model = checkpoint_model(path, spec, args)
    layout = peft_layout(model, spec.hf_adapter, args)
    if layout.parameters:
        check_peft_version()
    params = dict(model.named_parameters())
    saved = saved_dtypes(path, sorted({e.native for e in layout.entries.values()}))
    # Rounded to bf16, trained adapters put peft's logits 3.2e-3 from the merged export's on
    # tests/test_lora.py's tiny model (7.4 on a user's): the default keeps what training kept.
    dtype = dtype or functools.reduce(torch.promote_types, saved.values())
    values = {name: torch.empty(params[name].shape, dtype=saved[name]) for name in saved}
    entries = layout.entries.items()
    record, line = recorded_tokenizer(path) if tokenizer else (None, None)  # before any work
    with staged_export(out_dir) as staging:  # replaces out_dir whole, once complete
        if record is not None:
            line = write_tokenizer(record, staging, path)
        read_model_state(path, values)
        save_file(
            {PREFIX + k: e.to_peft(values[e.native]).to(dtype).contiguous() for k, e in entries},
            os.path.join(staging, WEIGHTS),
            metadata={"format": "pt"},
        )
        with open(os.path.join(staging, CONFIG), "w") as f:
            base = config["model"].get("init_from_hf")
            json.dump(adapter_config(peft, layout, base), f, indent=2)
    return line, dtype
