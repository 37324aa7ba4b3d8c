"""`python -m trainer.generate`: what a trained model answers, from a checkpoint or an export.

    python -m trainer.generate --checkpoint DIR (--prompt TEXT | --chat FILE) \\
        [--max-new-tokens 256] [--temperature 0] [--top-p 1] [--seed 0] [--device auto] [--json]

--checkpoint takes a checkpoint (OUTPUT_DIR/checkpoints/step-N), a job's output directory
(its newest checkpoint), or a Hugging Face export (`python -m trainer.hf.export`). One
process, on CPU or one GPU (--device).

--prompt TEXT is one user message, rendered with the chat template when the model has one
(with the generation prompt), else the raw text; --chat FILE a JSON list of messages
({"role": ..., "content": ...}) rendered with the template. A checkpoint's template is the
one its data was rendered with, with its --chat-template-kwargs.

Decoding is greedy (temperature 0, the default) or sampled (--temperature, --top-p, --seed),
and stops at a stop token (generation_config.json's eos_token_id, or the template's
end-of-turn tokens and the EOS a checkpoint records) or after --max-new-tokens. Prints the
answer (special tokens left out); --json prints {"prompt_ids", "ids", "text", "stopped"}.
Exit status 2 for bad input (one message).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from trainer.errors import USER_ERRORS, DataError, refuse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--checkpoint", required=True, help="a checkpoint, job directory or export")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user message (raw text without a chat template)")
    what.add_argument("--chat", help="a JSON file: a list of messages, rendered with the template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="of the sampling draws")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda[:N]")
    p.add_argument("--json", action="store_true", help="print the token ids too, as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse bad options before anything is loaded (DataError naming the fix)."""
    if args.max_new_tokens < 1:
        raise DataError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.temperature < 0:
        raise DataError(f"--temperature {args.temperature:g}: give 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise DataError(f"--top-p {args.top_p:g}: give a probability mass in (0, 1]")
    if not os.path.isdir(args.checkpoint):
        raise DataError(
            f"--checkpoint {args.checkpoint}: no such directory; give a checkpoint "
            "(OUTPUT_DIR/checkpoints/step-N), a job's output directory or an export"
        )


def read_chat(path: str) -> list[dict[str, Any]]:
    """The messages of a --chat file; DataError naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            messages = json.load(f)
    except OSError as err:
        raise DataError(f"--chat {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise DataError(f"--chat {path}: not JSON ({err}); give a list of messages") from None
    fix = 'give a JSON list of {"role": "user"|"assistant"|"system", "content": TEXT} objects'
    if not isinstance(messages, list) or not messages:
        raise DataError(f"--chat {path}: holds a {type(messages).__name__}, not a list; {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"--chat {path}: message {i} is not a role and a content; {fix}")
    return messages


def prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    """The prompt's ids: the messages rendered as prepare rendered the data (the text, then
    its tokens without added specials, as apply_chat_template tokenizes)."""
    tok = tokenizer.tok
    if not tokenizer.has_template:
        if args.chat is not None:
            raise DataError(
                f"--chat {args.chat}: {args.checkpoint} has no chat template to render messages "
                "with (its data was not prepared with --format chat); give --prompt TEXT, "
                "which is then taken as raw text"
            )
        return [int(i) for i in tok.encode(args.prompt)]  # the byte tokenizer's, or HF's
    messages = read_chat(args.chat) if args.chat else [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **tokenizer.template_kwargs
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    return device


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check(args)
        if args.chat is not None:
            read_chat(args.chat)  # before anything is loaded
        device = _device(args.device)
        from trainer.generate.decode import Sampling, generate
        from trainer.generate.load import load_model, load_tokenizer, resolve

        kind, path = resolve(args.checkpoint)
        tokenizer = load_tokenizer(kind, path)
        ids = prompt_ids(tokenizer, args)
        model = load_model(kind, path, device)
    except USER_ERRORS as err:
        return refuse(err)
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    stop = set(tokenizer.stop)
    new, stopped = generate(model, ids, stop, args.max_new_tokens, sampling)
    answer = new[:-1] if stopped else new
    tok = tokenizer.tok
    is_hf = hasattr(tok, "apply_chat_template")
    text = tok.decode(answer, skip_special_tokens=True) if is_hf else tok.decode(answer)
    if args.json:
        record = {"prompt_ids": ids, "ids": new, "text": text, "stopped": stopped}
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
