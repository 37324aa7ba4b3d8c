"""`python -m moetrain.export`: a training checkpoint as a Hugging Face directory.

    python -m moetrain.export --checkpoint outputs/run/checkpoints/step-1000 --out hf_model \\
        [--dtype bf16|fp32] [--max-shard-gb 4] [--adapters] [--no-tokenizer]

`--checkpoint` may also be a job's output directory: its newest complete checkpoint, as
`moetrain.generate` and `moetrain.evaluate` take it (`find_checkpoint`). Merged weights
(moetrain/export/merged.py, W + alpha/r * B @ A for a LoRA checkpoint: a plain directory) in
bf16 unless --dtype says otherwise; `--adapters`, a LoRA checkpoint's adapters alone in the
format peft loads (moetrain/export/adapters.py), in the dtype they were trained in unless
--dtype says otherwise. A last line says what was written, in which dtype, and why.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from moetrain.checkpoint.markers import find_checkpoint
from moetrain.errors import CheckpointError
from moetrain.export.adapters import export_adapters
from moetrain.export.merged import export_checkpoint
from moetrain.models import HFFormatError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """`--dtype`'s name of `dtype` (torch's, for one it does not offer)."""
    names = {v: k for k, v in DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def _check_shard_size(args: argparse.Namespace) -> str | None:
    """Why `--max-shard-gb` cannot be used as given, or None: it sizes the files of merged
    weights (0 or less wrote one file per tensor), and peft loads adapters from one file."""
    if args.max_shard_gb is None:
        return None
    if args.adapters:
        return (
            f"--max-shard-gb={args.max_shard_gb:g} with --adapters: the adapters are written to "
            "one file (adapter_model.safetensors), the one peft loads; drop --max-shard-gb"
        )
    if not (math.isfinite(args.max_shard_gb) and int(args.max_shard_gb * 2**30) >= 1):
        return (
            f"--max-shard-gb={args.max_shard_gb:g}: each safetensors file holds up to this many "
            "GiB, so it must be above 0, at least one byte (e.g. --max-shard-gb=4, the default)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moetrain.export", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a step-<N> checkpoint directory, or a job's output directory (its newest "
        "complete checkpoint; a line names it)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output directory: new, empty, or an earlier export (replaced whole)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the weights written (buffers keep theirs): merged weights default to "
        "bf16; --adapters default to the dtype they were trained in, which the checkpoint "
        "holds (fp32), as peft's save_pretrained keeps them. A line says which was written",
    )
    parser.add_argument(
        "--max-shard-gb",
        type=float,
        default=None,
        help="size of each safetensors file of merged weights, in GiB, above 0 (default 4); "
        "not with --adapters (one file, as peft loads it)",
    )
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA checkpoint's adapters alone, in the format peft loads (default: merged "
        "weights, a plain Hugging Face directory)",
    )
    parser.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="leave out the tokenizer the data was prepared with (default: its files, the "
        "chat template used and generation_config.json are written beside the weights)",
    )
    args = parser.parse_args(argv)
    problem = _check_shard_size(args)
    if problem is not None:  # before anything is read
        print(f"error: {problem}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        # A job's output directory means its newest complete checkpoint, as generate and
        # evaluate read it.
        checkpoint, note = find_checkpoint(args.checkpoint, "--checkpoint")
        if note is not None:
            print(note, flush=True)
        if args.adapters:
            line, dtype = export_adapters(checkpoint, args.out, dtype, not args.no_tokenizer)
            what = "adapters"
            why = "--dtype" if args.dtype else "the checkpoint's dtype; --dtype to change"
        else:
            dtype = dtype or torch.bfloat16
            shard_gb = 4.0 if args.max_shard_gb is None else args.max_shard_gb
            line = export_checkpoint(
                checkpoint, args.out, dtype, int(shard_gb * 2**30), not args.no_tokenizer
            )
            what = "weights"
            why = "--dtype" if args.dtype else "the default; --dtype to change"
    except (HFFormatError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if line is not None:
        print(line)
    print(f"wrote {args.out}: {what} in {dtype_name(dtype)} ({why}) from {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
