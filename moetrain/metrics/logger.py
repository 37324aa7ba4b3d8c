"""Per-step console line with a progress bar (rank 0) and metrics.jsonl.

No torch at import (the device queries import it when called): `python -m
moetrain.metrics.plot` reads metrics.jsonl through `read_records` without paying for it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import TYPE_CHECKING

from moetrain.fileio import write_atomic

if TYPE_CHECKING:
    import torch

# Dense bf16 peak FLOP/s by device-name fragment, for MFU.
_PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's peak resident set size (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def read_records(path: str) -> tuple[list[dict], list[int]]:
    """The records of a metrics.jsonl, and the numbers of the lines that are not one (a
    run killed mid-write leaves its last line half written)."""
    records, dropped = [], []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record:
                records.append(record)
            else:
                dropped.append(lineno)
    return records, dropped


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return f"line{'s' if len(numbers) > 1 else ''} {shown}"


class MetricsLogger:
    def __init__(
        self,
        output_dir: str,
        total_steps: int,
        is_rank0: bool,
        jsonl: bool,
        progress: bool,
        resume_step: int | None = None,
        sinks: list | None = None,
    ):
        self.sinks = sinks or []  # moetrain.metrics.sinks: TensorBoard, W&B (rank 0 only)
        self.total_steps = total_steps
        self.is_rank0 = is_rank0
        self.progress = progress
        self.path = os.path.join(output_dir, "metrics.jsonl") if jsonl else None
        self.start = time.monotonic()
        self.first_step = resume_step or 0  # for the ETA of a resumed run
        self.notes: list[str] = []  # what the constructor has to say, on the console
        if is_rank0 and self.path:
            os.makedirs(output_dir, exist_ok=True)
            kept: list[dict] = []
            if resume_step is not None and os.path.isfile(self.path):
                # Keep the history up to the checkpoint; steps after it will be redone.
                records, dropped = read_records(self.path)
                kept = [r for r in records if r["step"] <= resume_step]
                if dropped:
                    self.notes.append(
                        f"{self.path}: dropped {_lines(dropped)} that did not parse (a run "
                        "killed while writing it); the history goes on from the checkpoint"
                    )
            # NOTE: replaced, not rewritten in place: a kill during the rewrite must leave
            # the old history whole.
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def info(self, msg: str) -> None:
        if self.is_rank0:
            print(msg, flush=True)

    def log(self, record: dict) -> None:
        if not self.is_rank0:
            return
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        print(self._line(record), file=sys.stdout, flush=True)
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def _line(self, r: dict) -> str:
        step, total = r["step"], self.total_steps
        parts = [f"step {step:>{len(str(total))}}/{total}"]
        if self.progress:
            filled = int(20 * step / total)
            elapsed = time.monotonic() - self.start
            eta = elapsed / max(step - self.first_step, 1) * (total - step)
            parts.append(f"[{'#' * filled}{'.' * (20 - filled)}] eta {_hms(eta)}")
        parts.append(f"loss {r['loss']:.4f}")
        if r.get("mtp_loss") is not None:
            parts.append(f"mtp {r['mtp_loss']:.4f}")
        if r.get("rewards/margins") is not None:  # train.objective=dpo
            parts.append(f"margin {r['rewards/margins']:.4f} acc {r['rewards/accuracy']:.2f}")
        if r.get("aux_loss") is not None:
            parts.append(f"aux {r['aux_loss']:.4f}")
        if r.get("expert_load_max_over_mean"):  # the worst layer's balance
            worst = max(r["expert_load_max_over_mean"])
            starved = sum(r.get("expert_load_starved", []))
            parts.append(f"load max/mean {worst:.2f} (starved {starved})")
        parts += [
            f"gnorm {r['grad_norm']:.3f}",
            f"lr {r['lr']:.2e}",
            f"{r['tokens_per_s']:,.0f} tok/s",
            f"mem {r['peak_mem_gib']:.2f}GiB",
        ]
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("eval_loss") is not None:
            parts.append(f"eval {r['eval_loss']:.4f}")
        if r.get("eval_rewards/accuracy") is not None:
            parts.append(f"eval acc {r['eval_rewards/accuracy']:.2f}")
        if r.get("skipped"):
            parts.append("SKIPPED")
        return " | ".join(parts)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
