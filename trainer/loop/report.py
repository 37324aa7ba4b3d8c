"""What a run says besides its losses: the start-up lines and each step's figures."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.dims import ParallelDims
from trainer.config import JobConfig
from trainer.data.mixture import BlendedOrder
from trainer.data.run_data import RunData
from trainer.metrics.logger import peak_memory_gib


def startup_lines(
    cfg: JobConfig,
    dims: ParallelDims,
    model: nn.Module,
    dataset,
    data: RunData,
    grad_accum: int,
    device: torch.device,
) -> list[str]:
    """The model and layout, the data (each source of a blend: weight, size, share, epochs)
    and the held-out data."""
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        f"{cfg.model.name}: {n_params / 1e6:.2f}M params | world {dims.world_size} "
        f"(dp_replicate {dims.dp_replicate}, dp_shard {dims.dp_shard}, cp {dims.cp}, ep "
        f"{dims.ep}) | global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens, "
        f"micro {cfg.train.micro_batch_size}, grad accum {grad_accum} | {device}",
        dataset.summary.describe(cfg.data.seq_len, len(dataset)),
    ]
    run_samples = cfg.train.steps * cfg.train.global_batch_size
    lines += [source.describe(run_samples, cfg.data.seq_len) for source in data.sources]
    when = f"every {cfg.eval.interval} steps and " if cfg.eval.interval else ""
    lines += [
        f"eval: {h.name}: {h.samples} samples of {cfg.data.seq_len} tokens, {when}at the end "
        "of training"
        for h in data.held_out
    ]
    return lines


def step_figures(
    cfg: JobConfig,
    elapsed: float,
    device: torch.device,
    flops_per_token: float,
    peak_flops: float | None,
    dims: ParallelDims,
) -> dict:
    """Throughput, peak memory and MFU (on GPUs whose peak is known) of a step."""
    tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / elapsed
    mfu = None
    if peak_flops:
        mfu = tokens_per_s * flops_per_token / (peak_flops * dims.world_size)
    return {
        "tokens_per_s": tokens_per_s,
        "step_time_s": elapsed,
        "peak_mem_gib": peak_memory_gib(device),
        "mfu": mfu,
    }


def source_tokens(blend: BlendedOrder, consumed_samples: int, cfg: JobConfig) -> dict:
    """Each blended source's tokens trained on so far (exact: the blend's own counts)."""
    cursors = blend.cursors_at(consumed_samples)
    return {
        f"tokens/{name}": samples * cfg.data.seq_len
        for name, samples in zip(blend.keys, cursors, strict=True)
    }
