"""Where logged steps go besides the console and metrics.jsonl: TensorBoard and W&B.

Both are optional dependencies, imported only when asked for; `check_sinks` refuses a
config that asks for one that is not installed, before any process group exists. Only
rank 0 writes. A record is what metrics.jsonl gets: scalars by name, per-layer lists
(expert load max/mean) as one scalar per layer, and the [L, E] expert load as a
histogram per layer and one heatmap image.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol

import numpy as np

from moetrain.config import ConfigError, JobConfig, config_to_dict


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


_NEEDS = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb (metrics.wandb_mode=offline works with no network)"),
}


def check_sinks(cfg: JobConfig) -> None:
    for key, (module, fix) in _NEEDS.items():
        if getattr(cfg.metrics, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{key}=true needs the `{module}` package: {fix}")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in ("step", "expert_load") or value is None:
            continue
        if isinstance(value, bool | int | float):
            out[key] = float(value)
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            out.update({f"{key}/layer{i}": float(v) for i, v in enumerate(value)})
    return out


def _heatmap(load: np.ndarray) -> np.ndarray:
    """[L, E] counts -> [1, L, E] in [0, 1], each layer relative to its own busiest expert."""
    return (load / np.maximum(load.max(axis=1, keepdims=True), 1))[None]


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, step)
        if record.get("expert_load") is not None:
            load = np.asarray(record["expert_load"], dtype=np.float64)  # [L, E]
            for layer, row in enumerate(load):
                experts = np.repeat(np.arange(len(row)), row.astype(np.int64))
                self.writer.add_histogram(f"expert_load/layer{layer}", experts, step)
            self.writer.add_image("expert_load/heatmap", _heatmap(load), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: JobConfig) -> None:
        import wandb

        m = cfg.metrics
        self.run = wandb.init(
            project=m.wandb_project,
            name=m.wandb_run or cfg.job.name,
            mode=m.wandb_mode,
            dir=cfg.job.output_dir,
            config=config_to_dict(cfg),
        )

    def log(self, record: dict[str, Any]) -> None:
        import wandb

        values: dict[str, Any] = dict(_scalars(record))
        if record.get("expert_load") is not None:
            values["expert_load/heatmap"] = wandb.Image(
                _heatmap(np.asarray(record["expert_load"]))[0]
            )
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_sinks(cfg: JobConfig, is_rank0: bool) -> list[Sink]:
    if not is_rank0:
        return []
    sinks: list[Sink] = []
    if cfg.metrics.tensorboard:
        sinks.append(TensorBoardSink(os.path.join(cfg.job.output_dir, "tb")))
    if cfg.metrics.wandb:
        sinks.append(WandbSink(cfg))
    return sinks
