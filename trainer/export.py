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
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from models import HFFormatError, ModelSpec, get_model_spec
from trainer.checkpoint import TRAINER_STATE, CheckpointError, check_checkpoint
from trainer.hf_io import save_hf_checkpoint


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, ModelSpec, Any]:
    """The trained model of checkpoint `path`, unsharded, on CPU, its spec and its args."""
    check_checkpoint(path)
    config = torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)["config"]
    model_cfg = dict(config["model"])
    spec = get_model_spec(model_cfg.pop("name"))
    model_cfg.pop("init_from_hf", None)
    args = spec.args_cls(**model_cfg)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")  # no init: every weight comes from the checkpoint
    # Only the model's tensors are read (not the optimizer's), straight into the model.
    state = {"model": model.state_dict()}
    dcp.load(
        state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True
    )
    return model.eval(), spec, args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    try:
        model, spec, model_args = load_checkpoint_model(args.checkpoint)
        if spec.hf_adapter is None:
            raise HFFormatError(f"model {spec.name!r} has no Hugging Face adapter to export with")
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        save_hf_checkpoint(model, spec.hf_adapter, model_args, args.out, dtype)
    except (HFFormatError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.dtype}) from {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
