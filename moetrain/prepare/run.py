"""Offline tokenization: a corpus -> a prepared directory (format: moetrain/data/shards.py).

The corpus is cut into deterministic work units (moetrain/prepare/work_plan.py). Unit i
becomes shard i, tokenized and streamed to disk by a worker process (moetrain/prepare/worker.py)
and then recorded by a done marker in DIR/.work/. The manifest is written last, so its
presence means complete. The bytes written depend only on
the corpus, the tokenizer and --shard-mb (not on --workers), and a re-run of the same command
redoes only the units whose marker or files are missing or damaged.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

from moetrain.data import shards
from moetrain.data.shards import MANIFEST, Manifest, ShardInfo
from moetrain.errors import DataError
from moetrain.fileio import read_json, write_atomic
from moetrain.prepare import worker
from moetrain.prepare.summary import INPUT_KINDS, Summary, chat_turns_total
from moetrain.prepare.work_plan import (
    MIB,
    PrepareArgs,
    plan_source,
    repeat_command,
    tokenizer_identity,
)

PLAN = "plan.json"


def _clear(out: str) -> None:
    """Remove what a prepare wrote into `out` (and nothing else)."""
    shutil.rmtree(os.path.join(out, worker.WORK_DIR), ignore_errors=True)
    for path in glob.glob(os.path.join(out, "shard-*")) + glob.glob(os.path.join(out, MANIFEST)):
        os.remove(path)


def _holds_only_a_plan(out: str) -> bool:
    """Whether `out` holds no prepared work, only the plan of a run refused before its
    first shard (bad input that was then fixed: the rerun must not need --overwrite)."""
    work = os.path.join(out, worker.WORK_DIR)
    if set(os.listdir(out)) != {worker.WORK_DIR} or not os.path.isdir(work):
        return False
    return set(os.listdir(work)) <= {PLAN, PLAN + ".tmp"}


def _claim(out: str, plan: dict, overwrite: bool) -> None:
    """Make `out` hold this plan: a new directory, a resume of the same plan, or (only with
    --overwrite) a replacement of another one."""
    plan_path = os.path.join(out, worker.WORK_DIR, PLAN)
    old = read_json(plan_path)
    if old == plan:
        # Resume. The manifest means complete: drop it until every unit is checked again;
        # temporary files are what a killed run was writing.
        for path in [os.path.join(out, MANIFEST), *glob.glob(os.path.join(out, "*.tmp"))]:
            if os.path.exists(path):
                os.remove(path)
        return
    if os.listdir(out) and not _holds_only_a_plan(out):
        if not overwrite:
            if isinstance(old, dict):
                keys = ("source", "tokenizer", "shard_mb", "format")
                what = ", ".join(k for k in keys if old.get(k) != plan.get(k)) or "units"
                why = f"was prepared with a different plan (differs in: {what})"
            else:
                why = "is not empty and holds no prepare plan"
            raise DataError(
                f"--out {out!r} {why}: pass --overwrite to replace its prepared files, or "
                "choose another --out"
            )
        _clear(out)
    os.makedirs(os.path.join(out, worker.WORK_DIR), exist_ok=True)
    write_atomic(plan_path, json.dumps(plan, indent=1))


class Progress:
    """Bytes done / total, documents, tokens/s and ETA on stderr, at most twice a second."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.total, self.enabled = total_bytes, enabled
        self.done = self.fresh = self.docs = self.tokens = 0
        self.start = self.shown = time.monotonic()

    def add(self, nbytes: int, docs: int, tokens: int, fresh: bool) -> None:
        self.done += nbytes
        self.docs += docs
        self.tokens += tokens if fresh else 0
        self.fresh += nbytes if fresh else 0
        if self.enabled and time.monotonic() - self.shown >= 0.5:
            self.show()

    def show(self, end: str = "") -> None:
        self.shown = now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        rate = self.fresh / elapsed  # bytes/s of this run's own work
        eta = f"{(self.total - self.done) / rate:,.0f} s" if rate > 0 else "?"
        sys.stderr.write(
            f"\r{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  {self.docs:,} docs  "
            f"{self.tokens / elapsed:,.0f} tokens/s  ETA {eta}   {end}"
        )
        sys.stderr.flush()


def _run_inline(job: worker.Job, progress: Progress) -> list[dict]:
    results = []
    for index in range(len(job["units"])):
        result = worker.run_unit(job, index, progress.add)
        if "error" in result:
            raise DataError(result["error"])
        results.append(result)
    return results


def _run_pool(job: worker.Job, workers: int, progress: Progress) -> list[dict]:
    """Units on `workers` processes. Bad input in several units reports the lowest one."""
    # forkserver: workers start from a small clean process (a forked copy of this one would
    # inherit its threads and memory); the server imports the worker module once for all.
    # (Each child still re-runs the caller's __main__, as multiprocessing does: the CLI's is
    # light; a script calling prepare() should keep heavy imports under `if __name__`.)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["moetrain.prepare.worker"])
    count = len(job["units"])
    tasks, events, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    for index in [*range(count), *[None] * workers]:
        tasks.put(index)
    args = (job, tasks, events, stop, progress.enabled)
    procs = [ctx.Process(target=worker.serve, args=args, daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    checked = time.monotonic()
    try:
        while len(results) + len(errors) < count:
            try:
                kind, *payload = events.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind is None or time.monotonic() - checked > 1:
                # A killed worker (e.g. out of memory) sends nothing: its unit would never come.
                checked = time.monotonic()
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a worker process died (exit code {dead[0]}; out of memory?): run "
                        "the same command again to resume"
                    )
            if kind is None:
                continue
            if kind == "progress":
                progress.add(*payload)
            elif kind == "crash":
                raise RuntimeError(f"unit {payload[0]} failed in a worker:\n{payload[1]}")
            elif "error" in payload[1]:
                errors[payload[0]] = payload[1]["error"]
                stop.set()  # start no further unit; the ones before it still finish
            else:
                results[payload[0]] = payload[1]
            if errors and all(i in results for i in range(min(errors))):
                raise DataError(errors[min(errors)])
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=1 if len(results) == count else 0)
            if p.is_alive():
                p.terminate()
                p.join()
    return [results[i] for i in range(count)]


@contextlib.contextmanager
def _exclusive(out: str) -> Iterator[None]:
    """Hold a lock on `out`: two prepares writing the same files would corrupt them."""
    os.makedirs(out, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if we die
    except BlockingIOError:
        os.close(fd)
        raise DataError(
            f"another `python -m moetrain.prepare` is writing --out {out!r}: let it finish (or "
            "stop it) first"
        ) from None
    try:
        yield
    finally:
        os.close(fd)


def prepare(args: PrepareArgs) -> Summary:
    """Tokenize the corpus into args.out (resuming a run of the same plan there)."""
    start = time.monotonic()
    if not args.shard_mb > 0:
        raise DataError(f"--shard-mb must be > 0, got {args.shard_mb}")
    if args.truncate is not None and args.truncate < 1:
        raise DataError(
            f"--truncate must be >= 1 (the data.seq_len the documents must fit), got "
            f"{args.truncate}"
        )
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")
    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is a file, not a directory: choose another --out")
    tok_id, tok_path = tokenizer_identity(args)
    source, files, units = plan_source(args, max(1, int(args.shard_mb * MIB)))
    dtype = shards.token_dtype(tok_id.vocab_size).str
    plan = {
        "format": shards.FORMAT,
        "source": source,
        "tokenizer": asdict(tok_id),
        "dtype": dtype,
        "shard_mb": args.shard_mb,
        "units": units,
    }
    job: worker.Job = {
        "out": out,
        "kind": args.source,
        "files": files,
        "units": units,
        "dtype": dtype,
        "text_field": args.text_field,
        "tokenizer_path": tok_path,
        "eos_id": tok_id.eos_id,
        "hf": {"path": source.get("path"), "split": args.split},
        "block_bytes": shards.BLOCK_BYTES,
        "format": args.format,
        "tokenizer_arg": args.tokenizer,  # --format chat: the directory with the template
        "chat_template": args.chat_template,  # --format chat: or this template file
        "chat_turns": args.chat_turns,
        "tool_arguments": args.tool_arguments,
        "chat_template_kwargs": args.template_options(),
        "truncate": args.truncate,  # tokens a document keeps (None: all)
    }
    progress = Progress(sum(u["bytes"] for u in units), args.progress)
    workers = min(args.workers or os.cpu_count() or 1, len(units))
    with _exclusive(out):
        _claim(out, json.loads(json.dumps(plan)), args.overwrite)  # compared as JSON reads it
        try:
            if workers <= 1:  # no process to start: one unit after another, here
                results = _run_inline(job, progress)
            else:
                results = _run_pool(job, workers, progress)
        finally:
            if args.progress:
                progress.show(end="\n")
        infos = [
            ShardInfo(
                worker.shard_name(i),
                r["tokens"],
                r["documents"],
                r["sha256"],
                r["docs_sha256"],
                r["crc_sha256"],
                r.get("mask_sha256"),
                r.get("mask_crc_sha256"),
            )
            for i, r in enumerate(results)
            if r["documents"]  # a unit of blank lines only: no shard for readers to map
        ]
        manifest = Manifest(
            tokenizer=tok_id,
            dtype=dtype,
            shards=infos,
            source=source,
            command=repeat_command(args),
            loss_mask=args.format != "text",
            preference=args.format == "preference",
        )
        if manifest.num_documents == 0:
            dropped = sum(r.get("dropped_documents", 0) for r in results)
            if dropped:
                what = "pairs" if args.format == "preference" else "documents"
                raise DataError(
                    f"--truncate {args.truncate} left out every one of the {dropped:,} "
                    f"{what}: not one has a trained answer that fits whole in that many "
                    "tokens; raise --truncate (and data.seq_len with it), with --overwrite"
                )
            raise DataError(
                f"--path {args.path!r} holds no non-empty document ({len(units)} units read): "
                "check --path, --source and --text-field"
            )
        write_atomic(os.path.join(out, MANIFEST), manifest.to_json())
    return Summary(
        documents=manifest.num_documents,
        tokens=manifest.num_tokens,
        shards=len(infos),
        units_reused=sum(bool(r["reused"]) for r in results),
        bytes_read=sum(u["bytes"] for u, r in zip(units, results, strict=True) if not r["reused"]),
        seconds=time.monotonic() - start,
        replaced=sum(r.get("replaced_documents", 0) for r in results),
        # Units are in corpus order, whichever worker ran them: the first is the corpus' first.
        replaced_first=next(
            (r["replaced_first"] for r in results if r.get("replaced_first")), None
        ),
        chat_turns=chat_turns_total(results) if args.format == "chat" else None,
        format=args.format,
        input_kind=INPUT_KINDS[args.source],
        bytes_written=sum(
            os.path.getsize(path) for path in glob.glob(os.path.join(out, "shard-*"))
        ),
        truncate=args.truncate,
        truncated=sum(r.get("truncated_documents", 0) for r in results),
        dropped=sum(r.get("dropped_documents", 0) for r in results),
    )


def verify(out: str) -> Manifest:
    """Re-read every shard of a prepared directory: DataError naming the first bad file."""
    manifest = shards.read_manifest(out, key="--out")
    try:
        shards.check_shards(out, manifest, checksums=True)
    except DataError as err:
        raise DataError(
            f"{err} (running the same `python -m moetrain.prepare` command again redoes it)"
        ) from None
    return manifest
