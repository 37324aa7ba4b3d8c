"""What every benchmark ends with: its JSON object, to a file or stdout."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_result(result: dict, path: str | None) -> None:
    """`result` as indented JSON to `path`, or to stdout when no path is given."""
    text = json.dumps(result, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def train_run(argv: list[str], nproc: int, out_dir: str) -> tuple[list[dict], float, str]:
    """`train.py argv` on `nproc` CPU ranks writing to `out_dir`: (its metrics.jsonl
    records, wall seconds, the command); SystemExit with the command and the tail of
    stderr when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "train.py", *argv, f"--job.output_dir={out_dir}", "--metrics.log_interval=1",
           "--metrics.progress=false", "--checkpoint.interval=0"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records, seconds, shlex.join(cmd[2:])
