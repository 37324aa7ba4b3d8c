"""A `prepare` worker's memory on one very long document: does it grow with the line?

    python benchmarks/long_docs.py [--long-doc-mb 20,200] [--vocab 32768] [--json FILE]
        [--chat [--turns N]]

With --chat, the same for `prepare --format chat`: the long line is one conversation of
--turns rounds (ChatML, the BPE with its tokens), between 2 MiB of short conversations.

For each size, a jsonl of one line of that many MiB of text (`benchmarks/data.py`'s random
words, documents joined by "\n") between 2 MiB of short documents, prepared with
--workers 2 and a BPE tokenizer.json of --vocab trained here on --train-mb of the same
words (nothing is downloaded), while every process of the CLI is sampled from /proc every
50 ms: `worker_peak_rss_mib` is the highest VmHWM of the workers (the forkserver's
children), which must not grow with the line. Prints one JSON object (or writes --json
FILE), then a one-line summary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data import MIB, ROOT, generate, read_texts, summary_mb, train_bpe  # noqa: E402


def long_line_corpus(path: str, mib: float, seed: int) -> float:
    """A jsonl: 1 MiB of short documents, one line of `mib` MiB of text, 1 MiB of short ones.
    Returns the line's MiB."""
    generate(path + ".short", 2, seed + 1)
    generate(path + ".long", mib, seed)
    with open(path + ".short", encoding="utf-8") as f:
        short = f.readlines()
    with open(path + ".long", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        out.writelines(short[: len(short) // 2])
        start = out.tell()
        out.write('{"text": "')
        for i, line in enumerate(src):  # escaped as json.dumps escapes, "\n" between documents
            out.write(("\\n" if i else "") + json.dumps(json.loads(line)["text"])[1:-1])
        out.write('"}\n')
        line_bytes = out.tell() - start
        out.writelines(short[len(short) // 2 :])
    for suffix in (".short", ".long"):
        os.remove(path + suffix)
    return line_bytes / MIB


def process_tree(root: int) -> dict[int, int]:
    """The descendants of `root` (pid -> depth below it), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    depth, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            depth[child] = depth.get(pid, 0) + 1
            todo.append(child)
    return depth


def peak_mib(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        return max(int(line.split()[1]) / 1024 for line in f if line[:5] in ("VmHWM", "VmRSS"))
    return 0.0


def prepare_sampled(cmd: list[str]) -> tuple:
    """(the finished process, wall s, {pid: (depth, peak RSS MiB)} of it and its descendants)."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    peaks: dict[int, tuple[int, float]] = {}
    while proc.poll() is None:
        for pid, depth in [(proc.pid, 0), *process_tree(proc.pid).items()]:
            peaks[pid] = (depth, max(peaks.get(pid, (0, 0.0))[1], peak_mib(pid)))
        time.sleep(0.05)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    with contextlib.suppress(ChildProcessError):
        while True:  # the pool's orphans (its forkserver), as in child_cpu
            os.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), wall, peaks


# ChatML, as Qwen's chat models render conversations.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_tokenizer_dir(tok_json: str, directory: str) -> str:
    """A transformers tokenizer directory of `tok_json` with ChatML's tokens and template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=tok_json, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    return directory


def long_chat_corpus(path: str, mib: float, seed: int, turns: int) -> float:
    """A chat jsonl: 1 MiB of short conversations, one conversation of `mib` MiB of text in
    `turns` rounds (a user and an assistant message each), 1 MiB of short ones. Returns the
    long line's MiB."""
    generate(path + ".text", mib + 2, seed)
    texts = read_texts(path + ".text")
    os.remove(path + ".text")
    short, rest, size = [], [], 0
    for text in texts:  # the first 2 MiB: short conversations, the rest: the long one
        (short if size < 2 * MIB else rest).append(text)
        size += len(text)
    long_text = "\n".join(rest)
    cut = -(-len(long_text) // (2 * turns))
    parts = [long_text[i : i + cut] for i in range(0, len(long_text), cut)]
    roles = ["user", "assistant"] * turns
    long_line = json.dumps({"messages": [{"role": r, "content": c} for r, c in zip(roles, parts)]})
    with open(path, "w", encoding="utf-8") as out:
        for i, text in enumerate(short):
            if i == len(short) // 2:
                out.write(long_line + "\n")
            half = len(text) // 2
            messages = [{"role": "user", "content": text[:half]},
                        {"role": "assistant", "content": text[half:]}]  # fmt: skip
            out.write(json.dumps({"messages": messages}) + "\n")
    return len(long_line) / MIB


def measure_long_docs(args: argparse.Namespace, tmp: str, result: dict) -> None:
    train = os.path.join(tmp, "train.jsonl")
    generate(train, args.train_mb, args.seed)
    tok_json = os.path.join(tmp, "tokenizer.json")
    seconds = train_bpe(read_texts(train), args.vocab, tok_json)
    result["bpe"] = {"vocab": args.vocab, "train_mib": args.train_mb, "train_s": seconds}
    runs = result["long_docs"] = []
    tokenizer = chat_tokenizer_dir(tok_json, os.path.join(tmp, "chat")) if args.chat else tok_json
    for mib in (float(m) for m in args.long_doc_mb.split(",")):
        corpus, out = os.path.join(tmp, "long.jsonl"), os.path.join(tmp, "long-out")
        if args.chat:
            line_mib = long_chat_corpus(corpus, mib, args.seed, args.turns)
        else:
            line_mib = long_line_corpus(corpus, mib, args.seed)
        chat = ["--format", "chat"] if args.chat else []
        cmd = [sys.executable, "-m", "moetrain.prepare", "--source", "jsonl", "--path", corpus,
               "--tokenizer", tokenizer, "--out", out, "--workers", "2", "--shard-mb", "1",
               *chat]  # fmt: skip
        proc, wall, peaks = prepare_sampled(cmd)
        if proc.returncode != 0:
            raise SystemExit(f"prepare failed: {shlex.join(cmd)}\n{proc.stderr}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("prepared "))
        mb, seconds, rate = summary_mb(proc.stdout)
        workers = [peak for depth, peak in peaks.values() if depth >= 2]
        runs.append({"line_mib": line_mib, "file_mib": os.path.getsize(corpus) / MIB,
                     "mb": mb, "seconds": seconds, "mb_per_s": rate, "wall_s": wall,
                     "cli_line": line, "stderr": proc.stderr[-2000:],
                     "worker_peak_rss_mib": max(workers), "workers_sampled": len(workers),
                     "main_peak_rss_mib": max(p for d, p in peaks.values() if d == 0),
                     "all_peaks_mib": sorted(peak for _, peak in peaks.values())})  # fmt: skip
        os.remove(corpus)
        shutil.rmtree(out)
    kind = f"long chats ({args.turns} rounds)" if args.chat else "long docs"
    result["summary"] = f"{kind}: " + "; ".join(
        f"{r['line_mib']:.0f} MiB line -> worker peak RSS {r['worker_peak_rss_mib']:.0f} MiB "
        f"({r['mb_per_s']:.1f} MB/s)"
        for r in runs
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long-doc-mb", default="20,200", help="line sizes, MiB, comma-separated")
    p.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary size")
    p.add_argument("--train-mb", type=float, default=16.0, help="BPE training slice, MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="--format chat: one long conversation")
    p.add_argument("--turns", type=int, default=1, help="--chat: rounds of the long one")
    p.add_argument("--json", default=None, help="write the JSON here instead of stdout")
    args = p.parse_args()
    result: dict = {
        "command": shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="long-docs-bench-")
    try:
        measure_long_docs(args, tmp, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(args.json, "w") if args.json else contextlib.nullcontext(sys.stdout) as f:
        print(json.dumps(result, indent=1), file=f)
    print(result["summary"])


if __name__ == "__main__":
    main()
