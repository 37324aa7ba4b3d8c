"""`python -m moetrain.prepare`: tokenize a corpus once into prepared token shards.

    python -m moetrain.prepare --source jsonl --path 'data/**/*.jsonl' \\
        --tokenizer path/to/tokenizer.json --out prepared/ [--workers N] [--shard-mb 256]
    python -m moetrain.prepare --verify --out prepared/
    python -m moetrain.prepare --show 3 --out prepared/   # what training reads, decoded

Training then reads the directory with data.source=tokens. Re-running the same command after
an interruption finishes the job, redoing only what is missing. Exit status: 0 done, 2 bad
input or a failed --verify (one message on stderr naming the file and the fix).
"""

from __future__ import annotations

import argparse
import json
import sys

from moetrain.prepare.chat_tools import TOOL_ARGUMENTS  # light: no transformers, no torch

# Worker processes re-import this module as their __main__: the heavy imports (torch comes
# with moetrain.data) are inside main() so that those processes never pay for them.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moetrain.prepare",
        description="Tokenize a corpus into prepared token shards (see moetrain/data/shards.py).",
    )
    parser.add_argument("--source", choices=("jsonl", "text", "hf_datasets"))
    parser.add_argument("--path", help="glob of the files (quoted), or a dataset dir/name")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' (the default) or a tokenizer.json (--show: the one the manifest records)",
    )
    parser.add_argument("--out", required=True, help="the directory to write (or --verify)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    parser.add_argument(
        "--format",
        choices=("text", "chat", "prompt_completion", "preference"),
        default="text",
        help="jsonl lines: text (--text-field), chat ({messages: [{role, content}]}: the loss "
        "covers the assistant turns; --tokenizer names the model directory with its chat "
        "template), prompt_completion ({prompt, completion}: the loss covers the completion) "
        "or preference (TRL's conversational pairs {prompt, chosen, rejected}, or {chosen, "
        "rejected} sharing a prompt: two adjacent documents, each side's answer trained as "
        "chat trains a last answer; for train.objective=dpo)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="--format chat: render with the Jinja chat template in FILE instead of the "
        "tokenizer's (e.g. a training template that keeps every turn's think block)",
    )
    parser.add_argument(
        "--chat-turns",
        choices=("auto", "full", "per_turn", "last"),
        default="auto",
        help="--format chat: which renderings train the answers: full (one document per "
        "conversation), per_turn (one per answer, the conversation cut after it), last (the "
        "last answer), auto (full where the full rendering holds every answer as the "
        "conversation cut after it renders it, per_turn elsewhere)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='--format chat: options passed to the chat template, e.g. \'{"enable_thinking": '
        "false}' (Qwen3's non-thinking mode) or '{\"thinking\": true}' (DeepSeek-V3.1); a key "
        "the template never reads, or one transformers sets itself (messages, ...), is refused",
    )
    parser.add_argument(
        "--tool-arguments",
        choices=TOOL_ARGUMENTS,
        default="auto",
        help="--format chat: the form tool calls' arguments are rendered in: object (a "
        "mapping, transformers' convention), string (JSON text, DeepSeek-V3.1's) or auto (the "
        "form the template renders right, found on a probe call); each call is converted",
    )
    parser.add_argument("--text-field", default="text", help="jsonl/dataset field of the text")
    parser.add_argument("--split", default="train", help="hf_datasets split")
    parser.add_argument("--eos-token", default=None, help="token that ends each document")
    parser.add_argument(
        "--shard-mb", type=float, default=256.0, help="input MiB per work unit and shard"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a different plan")
    parser.add_argument("--progress", action="store_true", help="progress on stderr (TTY: on)")
    parser.add_argument(
        "--verify", action="store_true", help="re-check --out's sizes and checksums, then exit"
    )
    parser.add_argument(
        "--truncate",
        type=int,
        default=None,
        metavar="SEQ_LEN",
        help="cut each document to fit a sample of data.seq_len=SEQ_LEN (SEQ_LEN tokens and "
        "EOS): a conversation after its last whole answer that fits (one with none is left "
        "out), text at SEQ_LEN tokens; default: nothing is cut, and training leaves out "
        "instruction documents longer than a sample",
    )
    parser.add_argument(
        "--show",
        type=int,
        default=None,
        metavar="N",
        help="print --out's first N documents decoded, trained tokens marked, then exit",
    )
    args = parser.parse_args(argv)
    if args.show is not None:
        if args.verify:
            parser.error("--show and --verify are two commands: pass one")
        if args.show < 1:
            parser.error(f"--show takes how many documents to print (>= 1), got {args.show}")
        return args
    if args.tokenizer is None:
        args.tokenizer = "byte"
    if not args.verify and (args.source is None or args.path is None):
        parser.error("--source and --path are required (unless --verify or --show)")
    if args.format == "prompt_completion" and args.source != "jsonl":
        parser.error("--format prompt_completion reads JSON lines: use --source jsonl")
    if args.format in ("chat", "preference") and args.source == "text":
        parser.error(
            f"--format {args.format} reads JSON lines or dataset rows: use --source jsonl or "
            "hf_datasets"
        )
    chat_only = (
        ("--chat-template", args.chat_template, None, ("chat", "preference")),
        ("--chat-turns", args.chat_turns, "auto", ("chat",)),
        ("--chat-template-kwargs", args.chat_template_kwargs, None, ("chat", "preference")),
        ("--tool-arguments", args.tool_arguments, "auto", ("chat", "preference")),
    )
    for flag, value, default, formats in chat_only:
        if value != default and args.format not in formats:
            if formats == ("chat",) and args.format == "preference":
                parser.error(
                    f"{flag} picks a conversation's renderings; --format preference renders "
                    "each side's one answer as its last: remove it"
                )
            parser.error(f"{flag} renders conversations: it needs --format chat")
    if args.chat_template_kwargs is not None:
        try:
            options = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as err:
            parser.error(f"--chat-template-kwargs is not JSON ({err.msg} at column {err.colno})")
        if not isinstance(options, dict):
            parser.error(
                f"--chat-template-kwargs must be a JSON object of the template's options, e.g. "
                f"'{{\"enable_thinking\": false}}', not a {type(options).__name__}"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from moetrain.errors import DataError
    from moetrain.prepare.run import PrepareArgs, prepare, verify

    try:
        if args.show is not None:
            from moetrain.prepare.show import show

            for line in show(args.out, args.show, args.tokenizer):
                print(line)
            return 0
        if args.verify:
            manifest = verify(args.out)
            print(
                f"verified {args.out}: {len(manifest.shards)} shards, "
                f"{manifest.num_documents:,} documents, {manifest.num_tokens:,} tokens"
            )
            return 0
        summary = prepare(
            PrepareArgs(
                source=args.source,
                path=args.path,
                tokenizer=args.tokenizer,
                out=args.out,
                workers=args.workers,
                text_field=args.text_field,
                split=args.split,
                eos_token=args.eos_token,
                shard_mb=args.shard_mb,
                format=args.format,
                chat_template=args.chat_template,
                chat_turns=args.chat_turns,
                chat_template_kwargs=args.chat_template_kwargs,
                truncate=args.truncate,
                tool_arguments=args.tool_arguments,
                overwrite=args.overwrite,
                progress=args.progress or sys.stderr.isatty(),
            )
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(summary.line())
    if (chat := summary.chat_line()) is not None:
        print(chat)
    if (cut := summary.truncate_line()) is not None:
        print(cut)
    if (note := summary.note()) is not None:
        print(note, file=sys.stderr)
    return 0
