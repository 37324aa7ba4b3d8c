"""`python -m moetrain.generate`: what a trained model answers, from a checkpoint or an export.

    python -m moetrain.generate --checkpoint DIR (--prompt TEXT | --chat FILE) [--json]
    python -m moetrain.generate --checkpoint DIR --prompts FILE [--out FILE] [--batch-size 8]
        [--max-new-tokens 256] [--temperature 0] [--top-p 1] [--seed 0] [--device auto]

--checkpoint takes a checkpoint (OUTPUT_DIR/checkpoints/step-N), a job's output directory
(its newest checkpoint), or a Hugging Face export (`python -m moetrain.export`). One
process, on CPU or one GPU (--device).

--prompt TEXT is one user message, rendered with the chat template when the model has one
(with the generation prompt), else the raw text; --chat FILE a JSON list of messages
({"role": ..., "content": ...}) rendered with the template. A checkpoint's template is the
one its data was rendered with, with its --chat-template-kwargs. Prints the answer (special
tokens left out); --json prints {"prompt_ids", "ids", "text", "stopped"}.

--prompts FILE is JSONL, one prompt a line: {"messages": [...]} (as --chat) or {"prompt":
TEXT} (as --prompt); blank lines hold none. Every line is checked before the model loads.
Writes one JSON line per prompt, in the file's order, {"line", "text", "ids", "stopped"}
(`line`: the prompt's line in FILE), to stdout or --out FILE (written as FILE.partial,
renamed when complete: a failure leaves the finished answers there). Prompts are decoded
--batch-size at a time (left-padded, in the file's order).

Decoding keeps a KV cache (moetrain/generate/kv_cache.py). It is greedy (temperature 0, the
default) or sampled (--temperature, --top-p, --seed: each prompt draws from its own
generator seeded --seed, whatever the batch), and stops at a stop token
(generation_config.json's eos_token_id, or the template's end-of-turn tokens and the EOS a
checkpoint records) or after --max-new-tokens. Exit status 2 for bad input (one message).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moetrain.errors import USER_ERRORS, DataError, refuse
from moetrain.generate.inputs import Prompt, read_chat, read_prompts

if TYPE_CHECKING:  # torch is imported once the options are checked
    from moetrain.generate.batched import Answer

BATCH_SIZE = 8  # --prompts' default


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moetrain.generate", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--checkpoint", required=True, help="a checkpoint, job directory or export")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user message (raw text without a chat template)")
    what.add_argument("--chat", help="a JSON file: a list of messages, rendered with the template")
    what.add_argument("--prompts", help='a JSONL file: {"messages": [...]} or {"prompt": TEXT}')
    p.add_argument("--out", help="--prompts: write the answers' JSON lines here (not stdout)")
    p.add_argument("--batch-size", type=int, help=f"--prompts: decoded together ({BATCH_SIZE})")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, help="nucleus sampling's mass (1: all); sampling only")
    p.add_argument("--seed", type=int, help="of the sampling draws (0); sampling only")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda[:N]")
    p.add_argument("--json", action="store_true", help="print the token ids too, as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse bad options, and options set but ignored, before anything is loaded."""
    if args.max_new_tokens < 1:
        raise DataError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if not 0 <= args.temperature < math.inf:
        raise DataError(f"--temperature {args.temperature:g}: give 0 (greedy) or more")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise DataError(f"--top-p {args.top_p:g}: give a probability mass in (0, 1]")
    if args.temperature == 0:
        ignored = [f"--top-p {args.top_p:g}"] if args.top_p is not None and args.top_p < 1 else []
        ignored += [f"--seed {args.seed}"] if args.seed is not None else []
        if ignored:
            raise DataError(
                f"{' and '.join(ignored)} would be ignored with --temperature 0 (greedy "
                "decoding draws nothing); give --temperature > 0 to sample, or leave "
                f"{' and '.join(flag.split()[0] for flag in ignored)} out"
            )
    if args.prompts is None:
        options = (("--out", args.out), ("--batch-size", args.batch_size))
        given = [flag for flag, value in options if value is not None]
        if given:
            verb, them = ("apply", "them") if len(given) > 1 else ("applies", "it")
            raise DataError(
                f"{' and '.join(given)} {verb} to --prompts FILE only; with --prompt or --chat "
                f"the answer is printed: leave {them} out, or give the prompts as a --prompts file"
            )
    elif args.json:
        raise DataError("--json: --prompts always writes JSON lines; leave --json out")
    if args.batch_size is not None and args.batch_size < 1:
        raise DataError(f"--batch-size {args.batch_size}: give at least 1")
    if args.out is not None:
        folder = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out) or not os.path.isdir(folder):
            raise DataError(
                f"--out {args.out}: give a file path in an existing directory (not a directory)"
            )
    if not os.path.isdir(args.checkpoint):
        raise DataError(
            f"--checkpoint {args.checkpoint}: no such directory; give a checkpoint "
            "(OUTPUT_DIR/checkpoints/step-N), a job's output directory or an export"
        )


def _prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.prompts is not None:
        return read_prompts(args.prompts)
    if args.chat is not None:
        return [read_chat(args.chat)]
    return [Prompt("--prompt", text=args.prompt)]


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    return device


def _text(tok: Any, answer: Answer) -> str:
    """The answer's text: its ids without the stop token, special tokens left out."""
    ids = answer.ids[:-1] if answer.stopped else answer.ids
    is_hf = hasattr(tok, "apply_chat_template")
    return tok.decode(ids, skip_special_tokens=True) if is_hf else tok.decode(ids)


def _write_answers(
    args: argparse.Namespace,
    prompts: list[Prompt],
    ids: list[list[int]],
    decode: Callable[[list[list[int]]], list[Answer]],
    tok: Any,
) -> None:
    """Decode the --prompts in batches and write a JSON line per prompt as each batch ends
    (to --out FILE.partial, renamed FILE at the end; or stdout)."""
    partial = None if args.out is None else args.out + ".partial"
    out = sys.stdout if partial is None else open(partial, "w", encoding="utf-8")
    batch_size, started, done = args.batch_size or BATCH_SIZE, time.perf_counter(), 0
    try:
        for begin in range(0, len(prompts), batch_size):
            batch = slice(begin, begin + batch_size)
            for prompt, answer in zip(prompts[batch], decode(ids[batch]), strict=True):
                record = {
                    "line": prompt.line,
                    "text": _text(tok, answer),
                    "ids": answer.ids,
                    "stopped": answer.stopped,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            done += len(ids[batch])
            elapsed = time.perf_counter() - started
            print(f"{done}/{len(prompts)} prompts answered, {elapsed:.1f} s", file=sys.stderr)
    except BaseException:
        if partial is not None:
            print(
                f"the answers finished before the failure ({done} of {len(prompts)}) are in "
                f"{partial}",
                file=sys.stderr,
                flush=True,
            )
        raise
    finally:
        if partial is not None:
            out.close()
    if partial is not None:
        os.replace(partial, args.out)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check(args)
        prompts = _prompts(args)  # read and checked before anything is loaded
        device = _device(args.device)
        from moetrain.generate.batched import generate_batch
        from moetrain.generate.decode import Sampling
        from moetrain.generate.inputs import prompt_ids
        from moetrain.generate.load import load_model, load_tokenizer, resolve

        kind, path = resolve(args.checkpoint)
        tokenizer = load_tokenizer(kind, path)
        ids = [prompt_ids(tokenizer, p, args.checkpoint) for p in prompts]
        model, plan = load_model(kind, path, device)
    except USER_ERRORS as err:
        return refuse(err)
    sampling = Sampling(args.temperature, args.top_p or 1.0, args.seed or 0)
    stop = set(tokenizer.stop)

    def decode(batch: list[list[int]]):
        return generate_batch(model, plan, batch, stop, args.max_new_tokens, sampling)

    if args.prompts is not None:
        _write_answers(args, prompts, ids, decode, tokenizer.tok)
        return 0
    [answer] = decode(ids)
    text = _text(tokenizer.tok, answer)
    if args.json:
        record = {"prompt_ids": ids[0], "ids": answer.ids, "text": text, "stopped": answer.stopped}
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
