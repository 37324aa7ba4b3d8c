"""What a run says besides its losses: the start-up lines and each step's figures."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.build.distributed import Place
from moetrain.config import JobConfig
from moetrain.data.mixture import BlendedOrder
from moetrain.data.run_data import RunData
from moetrain.metrics.logger import peak_memory_gib
from moetrain.parallelisms.dims import ParallelDims
from moetrain.parallelisms.parallelize import Parallelized


def startup_lines(
    cfg: JobConfig, place: Place, model: nn.Module, grad_accum: int, parallel: Parallelized
) -> list[str]:
    """The model (`model`: the whole of it, also under pipeline stages) and the layout, and
    the stages' cut (`parallel`: what the plan made of this rank's part)."""
    dims = place.dims
    n_params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = f" ({trained / 1e6:.3f}M trained: LoRA)" if trained < n_params else ""
    pp = f"pp {dims.pp}, " if dims.pp > 1 else ""
    lines = [
        f"{cfg.model.name}: {n_params / 1e6:.2f}M params{frozen} | world {dims.world_size} "
        f"({pp}dp_replicate {dims.dp_replicate}, dp_shard {dims.dp_shard}, cp {dims.cp}, ep "
        f"{dims.ep}) | global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens, "
        f"micro {cfg.train.micro_batch_size}, grad accum {grad_accum} | {place.device}",
    ]
    if parallel.stage_blocks:
        copy = " (+ a copy of the embedding for its head)" if parallel.embedding_on_last else ""
        lines.append(pipeline_line(cfg.parallel.pp_schedule, parallel.stage_blocks) + copy)
    return lines


def data_lines(cfg: JobConfig, dataset, data: RunData) -> list[str]:
    """The corpus (`dataset`), each source of a blend (weight, size, share, epochs) and the
    held-out data."""
    lines = [dataset.summary.describe(cfg.data.seq_len, len(dataset))]
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


# An expert with under this share of its layer's mean load is "starved" in the metrics.
STARVED_SHARE = 0.1


def global_load(load: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The step's global expert load [L, E], from this rank's (assignments per MoE layer
    and expert, summed over its forwards): all-reduced over `group`, the ranks that hold the
    global batch once (each a distinct part of it): the world, or under pipeline stages one
    stage's ranks (`Meshes.batch_group`), since every stage's ranks hold the whole model's
    load by then (over the world it would count pp times). Queued, not read."""
    load = load.clone()
    dist.all_reduce(load, group=group)
    return load


def balance_figures(load: torch.Tensor) -> dict:
    """The routers' balance over the step's global batch, from `global_load`'s [L, E].

    expert_load_max_over_mean: per layer, the busiest expert's load over the mean, from 1
    (even) to E / k (every token on the same k experts: top-k of E). expert_load_starved:
    per layer, the experts under 10% of the mean load. Together they say what no pooled
    figure can: which layer is unbalanced, and whether experts sit idle in it.
    """
    mean = load.mean(1, keepdim=True)  # [L, 1]
    return {
        "expert_load": load.int().tolist(),
        "expert_load_max_over_mean": (load.max(1).values / mean[:, 0]).tolist(),
        "expert_load_starved": (load < STARVED_SHARE * mean).sum(1).tolist(),
    }


def pipeline_line(schedule: str, stage_blocks: list[list[str]]) -> str:
    """e.g. "pipeline: 1F1B, 2 stages: layers.0-1 | layers.2-3 (+ head)"."""

    def span(names: list[str]) -> str:
        first, last = names[0], names[-1]
        prefix = first.rpartition(".")[0]
        if first == last:
            return first
        if last.rpartition(".")[0] == prefix:
            return f"{first}-{last.rpartition('.')[2]}"
        return f"{first}..{last}"

    parts = " | ".join(span(b) for b in stage_blocks)
    return f"pipeline: {schedule}, {len(stage_blocks)} stages: embedding + {parts} + head"
