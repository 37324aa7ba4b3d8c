"""Data pipeline speed and memory: `python -m moetrain.prepare`, the loader, RSS per rank.

    python benchmarks/data.py [--quick] [--json FILE] [--keep] [--workers 1,2] [--machine TEXT]

Generates jsonl corpora of random words in a temporary directory (removed unless --keep) and
trains a small BPE tokenizer.json on a slice of one (nothing is downloaded). Then:

- prepare: the real CLI in a subprocess, byte and tokenizer.json, per --workers count, on a
  --prepare-mb corpus. `mb_per_s` is the CLI's own summary (input bytes over the time inside
  prepare(): no interpreter start-up or imports); `wall_mb_per_s` is over the subprocess'
  wall time; `mb_per_cpu_s` over the CPU time of it and its workers, less the CLI's imports.
  Reference: `tokenizers`' own encode_batch (all cores) over the same documents already in
  memory, in prepare's batch size: JSON parsing and file reading are not in the reference.
- reader: a --small-mb and a --large-mb corpus prepared with the byte tokenizer, each read in
  a fresh subprocess: `startup_s` is check_corpus + open_corpus (verify=size; and checksum
  for the large one), then --samples random samples through the dataset and through
  build_dataloader (GlobalBatchSampler, rank 0 of dp=8). `rss_growth_mib`: the peak RSS
  (VmHWM, reset after imports; ru_maxrss inherits the parent's peak across vfork+exec) less
  the RSS after imports; `rss_end` splits RSS into anonymous and file-backed (mapped shard
  pages: shared between ranks, reclaimable). `verify`: the same samples read a second time,
  when every block they touch is verified: the difference is the cost of the block checks
  (whole 64 KiB blocks read and CRC-32'd on first touch), per sample; also at seq 128 (the
  debug configs' samples) on the large corpus.

Long documents (a worker's memory on one very long line): benchmarks/long_docs.py.

Sizes are MiB (flags); rates MB/s = 1e6 bytes/s (the CLI prints kB, MB or GB: summary_mb). Prints one JSON object
(or writes --json FILE), then a one-line summary. The page cache is warm throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from synthetic_corpus import MIB, generate, read_texts, train_bpe  # noqa: E402  (this script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_CHARS = 1 << 20  # text per encode_batch call, as moetrain/prepare/worker.py batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--small-mb", type=float, default=10.0, help="small reader corpus, MiB")
    p.add_argument("--large-mb", type=float, default=1024.0, help="large reader corpus, MiB")
    p.add_argument("--prepare-mb", type=float, default=100.0, help="prepare corpus, MiB")
    p.add_argument("--train-mb", type=float, default=16.0, help="BPE training slice, MiB")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--workers", default="1,2", help="prepare --workers counts, comma-separated")
    p.add_argument("--shard-mb", type=float, help="of the prepare runs (default: 4 per worker)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--samples", type=int, default=20000, help="samples read per reader pass")
    p.add_argument("--micro-batch", type=int, default=8, help="loader micro-batch (dp=8)")
    p.add_argument("--no-checksum", action="store_true", help="skip verify=checksum start-up")
    p.add_argument("--repeats", type=int, default=2, help="prepare runs each; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--machine", default="", help="a description of this machine, for the JSON")
    p.add_argument("--json", default=None, help="write the JSON here instead of stdout")
    p.add_argument("--reader", default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--verify", default="size", help=argparse.SUPPRESS)
    p.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.small_mb, args.large_mb, args.prepare_mb, args.train_mb = 5, 50, 20, 4
        args.samples, args.repeats = min(args.samples, 4000), 1
    return args


def encode_batch_reference(tokenizer_json: str, corpus: str, repeats: int) -> dict:
    """tokenizers' own encode_batch over the corpus' texts in memory, in prepare's batches."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    texts = read_texts(corpus)
    batches, chars = [[]], 0
    for text in texts:
        if chars >= BATCH_CHARS:  # a batch ends once it holds BATCH_CHARS, as in prepare
            batches.append([])
            chars = 0
        batches[-1].append(text)
        chars += len(text)
    tok.encode_batch(batches[0][:8], add_special_tokens=False)  # thread pool up
    times, cpus = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for b in batches:
            tok.encode_batch(b, add_special_tokens=False)
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)  # all of this process' threads
    mb = os.path.getsize(corpus) / 1e6  # the CLI's numerator: input file bytes
    return {"seconds": min(times), "mb_per_s": mb / min(times), "mb_per_cpu_s": mb / min(cpus),
            "all_mb_per_s": [mb / t for t in times], "batches": len(batches),
            "text_mb": sum(len(t.encode()) for t in texts) / 1e6}  # fmt: skip


# The CLI's summary line: "prepared ...: read 104.9 MB of JSON lines in 1.3 s (79.8 MB/s), ..."
SUMMARY = re.compile(r"read ([\d,.]+) ([kMG]?B) of .+? in ([\d.]+) s \(([\d,.]+) ([kMG]?B)/s\)")
_UNIT_MB = {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}


def summary_mb(stdout: str) -> tuple[float, float, float]:
    """(MB read, seconds, MB/s) from the CLI's output (the line that starts "prepared")."""
    line = next(x for x in stdout.splitlines() if x.startswith("prepared "))
    size, unit, seconds, rate, rate_unit = SUMMARY.search(line).groups()
    return _mb(size, unit), float(seconds), _mb(rate, rate_unit)


def _mb(number: str, unit: str) -> float:
    return float(number.replace(",", "")) * _UNIT_MB[unit]


def child_cpu(cmd: list[str], env: dict | None = None) -> tuple:
    """(the finished process, wall s, CPU s of it and all its descendants)."""
    before, start = os.times(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    with contextlib.suppress(ChildProcessError):
        while True:  # the pool's orphans (its forkserver): main() made us their subreaper
            os.wait()
    return proc, wall, sum(os.times()[2:4]) - sum(before[2:4])


def prepare_once(corpus, out, tokenizer, workers, shard_mb, env, import_cpu) -> dict:
    cmd = [sys.executable, "-m", "moetrain.prepare", "--source", "jsonl", "--path", corpus,
           "--tokenizer", tokenizer, "--out", out, "--workers", str(workers)]  # fmt: skip
    cmd += [] if shard_mb is None else ["--shard-mb", str(shard_mb)]
    shutil.rmtree(out, ignore_errors=True)  # else the CLI would resume, reusing the shards
    proc, wall, cpu = child_cpu(cmd, env)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("prepared "))
    mb, seconds, rate = summary_mb(proc.stdout)
    with open(os.path.join(out, "manifest.json")) as f:
        shards = len(json.load(f)["shards"])
    return {"mb": mb, "seconds": seconds, "mb_per_s": rate, "wall_s": wall,
            "wall_mb_per_s": mb / wall, "cpu_s": cpu, "shards": shards, "cli_line": line,
            "mb_per_cpu_s": mb / max(cpu - import_cpu, 1e-3)}  # fmt: skip


def run_prepare(corpus, out, tokenizer, workers, shard_mb, repeats, import_cpu, one_thread=False):
    """The best of `repeats` runs. The environment is the user's, without
    TOKENIZERS_PARALLELISM (or with it false: `one_thread`, one tokenizer thread per worker)."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env.update({"TOKENIZERS_PARALLELISM": "false"} if one_thread else {})
    args = corpus, out, tokenizer, workers, shard_mb, env, import_cpu
    runs = [prepare_once(*args) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["mb_per_s"])
    return {"tokenizer": "byte" if tokenizer == "byte" else "tokenizer.json",
            "workers": workers, "tokenizers_parallelism": "false" if one_thread else "unset",
            **best, "mb_per_s_per_worker": best["mb_per_s"] / workers,
            "all_mb_per_s": [r["mb_per_s"] for r in runs]}  # fmt: skip


def rss() -> dict:
    """MiB: peak (VmHWM), current, anonymous and file-backed resident memory."""
    keys = {"VmHWM": "peak", "VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    with open("/proc/self/status") as f:
        pairs = (line.split(":", 1) for line in f)
        return {keys[k]: int(v.split()[0]) / 1024 for k, v in pairs if k in keys}


def reader_child(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    sys.path.insert(0, ROOT)
    import torch  # noqa: F401

    from moetrain.config import DataSection, TrainSection
    from moetrain.data.corpus import check_corpus, open_corpus
    from moetrain.data.loader import build_dataloader
    from moetrain.data.packing import PackedDataset
    from moetrain.data.tokenizers import ByteTokenizer

    result = {"imports_s": time.perf_counter() - start, "rss_after_imports": rss()}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS: the import's own peak is not ours
    cfg = DataSection(source="tokens", path=args.reader, seq_len=args.seq_len, verify=args.verify)
    tokenizer, t0 = ByteTokenizer(), time.perf_counter()
    check_corpus(cfg, tokenizer)
    stream, summary, _ = open_corpus(cfg, tokenizer)  # as a run opens the corpus
    dataset = PackedDataset(stream, cfg.seq_len, tokenizer.eos_id, summary, cfg.reset_positions)
    result.update(startup_s=time.perf_counter() - t0, num_samples=len(dataset))
    if not args.startup_only:
        idx = np.random.default_rng(args.seed).integers(0, len(dataset), args.samples)
        t0 = time.perf_counter()
        for i in idx.tolist():
            dataset[i]
        cold = time.perf_counter() - t0
        result["dataset_samples_per_s"] = args.samples / cold
        # The same samples again: every block they touch is verified now, so the difference
        # is the cost of the first reads' block checks (read whole blocks + CRC-32).
        t0 = time.perf_counter()
        for i in idx.tolist():
            dataset[i]
        warm = time.perf_counter() - t0
        result["verify"] = {
            "first_read_us_per_sample": 1e6 * cold / args.samples,
            "verified_read_us_per_sample": 1e6 * warm / args.samples,
            "check_us_per_sample": 1e6 * (cold - warm) / args.samples,
        }
        result["rss_after_dataset"] = rss()
        del dataset  # unmaps its shards; the loader opens its own
        mb = args.micro_batch
        train = TrainSection(global_batch_size=8 * mb, micro_batch_size=mb, seed=args.seed)
        t0 = time.perf_counter()
        loader, _ = build_dataloader(cfg, train, dp_rank=0, dp_size=8, tokenizer=tokenizer)
        next(batches := iter(loader))
        result["loader_first_batch_s"] = time.perf_counter() - t0
        t0, read = time.perf_counter(), 0
        while read < args.samples:
            read += next(batches).input_ids.shape[0]
        result["loader_samples_per_s"] = read / (time.perf_counter() - t0)
    end = result["rss_end"] = rss()
    result["rss_growth_mib"] = end["peak"] - result["rss_after_imports"]["rss"]
    result["peak_rss_mib"] = max(end["peak"], result["rss_after_imports"]["peak"])
    print(json.dumps(result))


def run_reader(args: argparse.Namespace, directory: str, verify: str, startup_only: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--reader", directory, "--verify", verify,
           "--seq-len", str(args.seq_len), "--samples", str(args.samples),
           "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]  # fmt: skip
    cmd += ["--startup-only"] if startup_only else []
    proc, wall, _ = child_cpu(cmd)
    if proc.returncode != 0:
        raise SystemExit(f"reader failed: {shlex.join(cmd)}\n{proc.stderr}")
    return {"verify": verify, "process_wall_s": wall,
            **json.loads(proc.stdout.strip().splitlines()[-1])}  # fmt: skip


def measure(args: argparse.Namespace, tmp: str, result: dict) -> None:
    workers = [int(w) for w in args.workers.split(",")]
    shard_mb = args.shard_mb or max(1.0, args.prepare_mb / (4 * max(workers)))
    result["settings"]["prepare_shard_mb"] = shard_mb
    corpora = {name: os.path.join(tmp, f"{name}.jsonl") for name in ("prepare", "small", "large")}
    gen = result["generate"] = {}
    for i, (name, mib) in enumerate(zip(corpora, (args.prepare_mb, args.small_mb, args.large_mb))):
        t0 = time.perf_counter()
        gen[name] = {"mib": generate(corpora[name], mib, args.seed + i) / MIB}
        gen[name]["seconds"] = time.perf_counter() - t0
    tok_json = os.path.join(tmp, "tokenizer.json")
    seconds = train_bpe(
        read_texts(corpora["prepare"], int(args.train_mb * MIB)), args.vocab, tok_json
    )
    result["bpe"] = {"vocab": args.vocab, "train_mib": args.train_mb, "train_s": seconds}
    out, runs = os.path.join(tmp, "prep"), []
    # CPU of the CLI's interpreter and imports, taken off each run's CPU for its MB per CPU-s.
    imp = child_cpu([sys.executable, "-c", "import moetrain.prepare.run"])[2]
    result["prepare_import_cpu_s"] = imp
    for tok in ("byte", tok_json):
        runs += [run_prepare(corpora["prepare"], out, tok, w, shard_mb, args.repeats, imp)
                 for w in workers]  # fmt: skip
    # With one worker the CLI tokenizes inline, where encode_batch uses every core: this run
    # pins it to one thread, as each pool worker is, for the scaling per worker.
    runs.append(run_prepare(corpora["prepare"], out, tok_json, 1, shard_mb, args.repeats, imp, 1))
    shutil.rmtree(out)
    ref = encode_batch_reference(tok_json, corpora["prepare"], args.repeats)
    for r in runs:
        if r["tokenizer"] == "tokenizer.json":
            r["vs_encode_batch"] = r["mb_per_s"] / ref["mb_per_s"]
            r["vs_encode_batch_per_cpu_s"] = r["mb_per_cpu_s"] / ref["mb_per_cpu_s"]
    result["prepare"], result["encode_batch_reference"] = runs, ref
    readers = result["reader"] = {}
    for name in ("small", "large"):
        out = os.path.join(tmp, f"tokens-{name}")
        prep = run_prepare(corpora[name], out, "byte", max(workers), None, 1, imp)
        os.remove(corpora[name])  # disk: the jsonl is no longer needed
        size = sum(e.stat().st_size for e in os.scandir(out) if e.is_file()) / MIB
        readers[name] = {"corpus_mib": gen[name]["mib"], "prepared_mib": size, "prepare": prep,
                         "read": run_reader(args, out, "size", False)}  # fmt: skip
        if name == "large":  # the debug configs' samples: 129 tokens
            short = argparse.Namespace(**{**vars(args), "seq_len": 128})
            readers[name]["read_seq_128"] = run_reader(short, out, "size", False)
    if not args.no_checksum:
        large = os.path.join(tmp, "tokens-large")
        readers["large"]["checksum_startup"] = run_reader(args, large, "checksum", True)


def main() -> None:
    args = parse_args()
    if args.reader:
        return reader_child(args)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # the reference: all cores, explicitly
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: see child_cpu
    import tokenizers
    import torch

    result: dict = {
        "command": shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"description": args.machine, "cores": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "tokenizers": tokenizers.__version__,
                     "numpy": np.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("reader", "json")},
    }  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="data-bench-")  # under $TMPDIR, else /tmp
    try:
        measure(args, tmp, result)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result["goals"], summary = goals_and_summary(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") if args.json else contextlib.nullcontext(sys.stdout) as f:
        print(json.dumps(result, indent=1), file=f)
    print(summary)


def goals_and_summary(result: dict) -> tuple[dict, str]:
    runs = {(r["tokenizer"], r["workers"], r["tokenizers_parallelism"]): r
            for r in result["prepare"]}  # fmt: skip
    hi = max(w for _, w, _ in runs)
    byte, tok = runs[("byte", hi, "unset")], runs[("tokenizer.json", hi, "unset")]
    one = runs[("tokenizer.json", 1, "false")]
    small, large = (result["reader"][k] for k in ("small", "large"))
    sr, lr = small["read"], large["read"]
    peak_ratio = lr["peak_rss_mib"] / sr["peak_rss_mib"]
    anon = [r["rss_end"]["anon"] - r["rss_after_imports"]["anon"] for r in (sr, lr)]
    speedup = tok["mb_per_s"] / one["mb_per_s"]
    goals = {
        "rss_flat_within_10pct": {"peak_rss_ratio_large_small": peak_ratio,
                                  "growth_mib": [sr["rss_growth_mib"], lr["rss_growth_mib"]],
                                  "anon_growth_mib": anon, "met": peak_ratio <= 1.10},
        "startup_under_2s_large": {"startup_s": lr["startup_s"], "met": lr["startup_s"] < 2.0},
        "tokenizer_json_ge_90pct_encode_batch": {"ratio": tok["vs_encode_batch"],
                                                 "ratio_per_cpu_s": tok["vs_encode_batch_per_cpu_s"],
                                                 "met": tok["vs_encode_batch"] >= 0.9},
        # At least 80% of linear, from one single-threaded worker to the most workers.
        "scales_with_workers": {"speedup": speedup, "workers": hi,
                                "met": speedup >= 0.8 * hi if hi > 1 else None},
    }  # fmt: skip
    summary = (
        f"data: prepare byte {hi}w {byte['mb_per_s']:.1f} MB/s "
        f"({byte['mb_per_s_per_worker']:.1f}/worker), tokenizer.json {hi}w "
        f"{tok['mb_per_s']:.1f} MB/s = {tok['vs_encode_batch']:.2f} of encode_batch "
        f"({speedup:.2f}x one 1-thread worker); loader {lr['loader_samples_per_s']:,.0f} "
        f"samples/s; RSS +{sr['rss_growth_mib']:.0f} MB ({small['corpus_mib']:.0f} MB) vs "
        f"+{lr['rss_growth_mib']:.0f} MB ({large['corpus_mib']:.0f} MB); start-up "
        f"{lr['startup_s']:.2f} s ({large['corpus_mib']:.0f} MB); block checks "
        f"{lr['verify']['check_us_per_sample']:.0f} us/sample (seq {result['settings']['seq_len']}), "
        f"{large['read_seq_128']['verify']['check_us_per_sample']:.0f} us/sample (seq 128)"
    )
    return goals, summary


if __name__ == "__main__":
    main()
