"""Turn a training checkpoint into a Hugging Face model directory.

    python -m trainer.hf.export --checkpoint outputs/run/checkpoints/step-1000 --out hf_model \\
        [--dtype bf16|fp32] [--max-shard-gb 4] [--adapters] [--no-tokenizer]

`--checkpoint` may also be a job's output directory: its newest complete checkpoint, as
`trainer.generate` and `trainer.evaluate` take it (`find_checkpoint`). One process, no GPU
needed, streaming: DCP reads the global tensors (from the shards of any layout) a group of
parameters at a time, the model's HF adapter turns each into its per-expert keys, and each
safetensors file is written as soon as it is full. Peak memory is about one read group plus
one output shard (and the largest single parameter), never the model. A LoRA checkpoint
exports merged weights, W + alpha/r * B @ A: a plain directory (bf16 unless --dtype says
otherwise); `--adapters` writes the adapters alone for peft, in the dtype they were trained
in unless --dtype says otherwise (peft_export.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

from models import HFFormatError
from models.common.lora import adapted_weights, merged
from models.spec import ModelSpec
from parallelisms.init import named_weights
from trainer.checkpoint.markers import find_checkpoint, read_trainer_state
from trainer.errors import CheckpointError
from trainer.hf.checkpoint_source import build_model, checkpoint_spec, read_model_state
from trainer.hf.export_dir import staged_export
from trainer.hf.export_tokenizer import recorded_tokenizer, write_tokenizer
from trainer.hf.weights import SafetensorsWriter, hf_entries


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, ModelSpec, Any]:
    """The trained model of checkpoint `path`, whole and unsharded on CPU, its spec and args
    (for tests and small models; `export_checkpoint` streams instead)."""
    spec, args = checkpoint_spec(path)
    with torch.device("meta"):
        model = build_model(path, spec, args)
    model.to_empty(device="cpu")  # no init: every weight comes from the checkpoint
    state = model.state_dict()
    if not read_trainer_state(path).get("frozen_saved", True):  # LoRA adapters alone
        with torch.no_grad():
            for name, value in _base(path, spec, args).items():
                state.pop(name).copy_(value)
        state.update({n: b for n, b in model.named_buffers()})  # saved all the same
    read_model_state(path, state)
    return model.eval(), spec, args


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


def _base(path: str, spec: ModelSpec, args: Any) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA checkpoint saved without it, whole on CPU: the weights its
    run started from (`trainer.loop.frozen_base`), refused if they are gone or changed."""
    from trainer.loop.frozen_base import check_base, load_base, recorded_base

    base = recorded_base(path, read_trainer_state(path))
    check_base(path, base)
    model = spec.build(args)
    load_base(base, model, spec, args, whole=None)
    return dict(named_weights(model))


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
    the tokenizer its data was prepared with (`tokenizer`; export_tokenizer.py).
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
    with torch.device("meta"):  # names, global shapes and dtypes; no memory
        model = build_model(path, spec, args)
    buffers = {name for name, _ in model.named_buffers()}
    adapted, params = adapted_weights(model), dict(model.named_parameters())
    # LoRA adapters saved alone (checkpoint.save_frozen=false): the base is rebuilt whole,
    # from where the run took it; else it streams from the checkpoint.
    base = None if read_trainer_state(path).get("frozen_saved", True) else _base(path, spec, args)
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
        prog="python -m trainer.hf.export", description=__doc__.splitlines()[0]
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
            from trainer.hf.peft_export import export_adapters

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
