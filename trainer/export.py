"""Turn a training checkpoint into a Hugging Face model directory.

    python -m trainer.export --checkpoint outputs/run/checkpoints/step-1000 --out hf_model \\
        [--dtype bf16|fp32]

One process, no GPU needed: DCP reassembles the global tensors from the shards of any
layout, and the model's HF adapter writes config.json + safetensors with per-expert keys.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from models import get_model_spec
from trainer.checkpoint import TRAINER_STATE, check_checkpoint
from trainer.hf_io import save_hf_checkpoint


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, object]:
    """The trained model of checkpoint `path`, unsharded, on CPU (and its spec)."""
    check_checkpoint(path)
    config = torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)["config"]
    model_cfg = dict(config["model"])
    spec = get_model_spec(model_cfg.pop("name"))
    model_cfg.pop("init_from_hf", None)
    model = spec.model_cls(spec.args_cls(**model_cfg))
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(path, full)
        state = torch.load(full, weights_only=False)["model"]
    model.load_state_dict(state)
    return model, spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    try:
        model, spec = load_checkpoint_model(args.checkpoint)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    save_hf_checkpoint(model, spec.hf_adapter, model.args, args.out, dtype)
    print(f"wrote {args.out} ({args.dtype}) from {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
