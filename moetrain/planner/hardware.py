"""The machines the planner's step-time model runs on (`moetrain.planner.step_cost`): one
GPU's compute and its node's links (`Hardware`, the `--hardware` presets), which link a
group of ranks' collectives cross (`link`), and the measured efficiency of each kind of
kernel (`--gemm-rates FILE`). The lowest layer of the planner: it imports none of it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU and its node's links; each figure is named, and a flag overrides it
    (`moetrain.planner.flags.HW_FLAGS`). The presets' figures are per GPU: nominal ones,
    or measured where a source states them (H800: DeepSeek-V3's report)."""

    name: str
    tflops: float  # dense bf16 peak per GPU
    efficiency: float  # the fraction of that peak the kernels reach
    intra_gbps: float  # GB/s per GPU per direction inside a node (NVLink)
    inter_gbps: float  # GB/s per GPU per direction across nodes (one NIC per GPU)
    ranks_per_node: int
    memory_gib: float
    # GB/s of the GPU's memory (HBM): what the optimizer step, which streams the state,
    # runs at (`step_cost.optimizer_seconds`)
    memory_gbps: float = 3350.0


PRESETS = {
    # 8 x H100 SXM: NVLink 4 (900 GB/s both ways), one 400 Gb/s NIC per GPU, HBM3 3.35 TB/s
    "h100": Hardware("8 x H100 SXM, NVLink 4, 8 x 400 Gb/s", 989, 0.5, 450, 50, 8, 80, 3350),
    # 8 x H200 SXM: the same compute and links, more and faster memory (HBM3e 4.8 TB/s)
    "h200": Hardware("8 x H200 SXM, NVLink 4, 8 x 400 Gb/s", 989, 0.5, 450, 50, 8, 141, 4800),
    # DeepSeek-V3's cluster, as its report states it (section 3.2.2): NVLink 160 GB/s per
    # GPU usable (of the nominal 200 per direction), InfiniBand 50 GB/s per GPU (400 Gb/s);
    # the H800's HBM3 is the H100's, 3.35 TB/s
    "h800": Hardware(
        "8 x H800, NVLink 160 GB/s usable, IB 50 GB/s (DeepSeek-V3 report)",
        989,
        0.5,
        160,
        50,
        8,
        80,
        3350,
    ),
}


def hardware(preset: str, **overrides: float | None) -> Hardware:
    hw = PRESETS[preset]
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})


def link(group: int, hw: Hardware) -> float:
    """GB/s of a group of `group` consecutive ranks' collectives."""
    return hw.intra_gbps if group <= hw.ranks_per_node else hw.inter_gbps


def read_rates(path: str) -> dict:
    """The measured efficiency of each kind of kernel from `benchmarks/gemm_rates.py`'s JSON:
    {"file", "model", "device", "peak_tflops", "efficiency": {kind: fraction of that peak}}."""
    from moetrain.config import ConfigError

    try:
        with open(path) as f:
            data = json.load(f)
        kinds = data["categories"]
        efficiency = {k: float(v["efficiency"]) for k, v in kinds.items() if v.get("efficiency")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"--gemm-rates {path}: not the JSON of benchmarks/gemm_rates.py ({err!r})"
        ) from err
    if any(e <= 0 for e in efficiency.values()):
        raise ConfigError(f"--gemm-rates {path}: an efficiency <= 0: {efficiency}")
    peak = data.get("peak_tflops")
    return {
        "file": path,
        "model": data.get("model"),
        "device": data.get("device"),
        "peak_tflops": float(peak) if peak else None,
        "efficiency": efficiency,
    }


def rates_by_kind(rates: dict, flops_per_token: float, hw: Hardware) -> dict:
    """kind -> (training FLOPs per token, efficiency against `hw.tflops`) for `estimate`.
    The file's efficiencies are fractions of the peak it was measured against: converted,
    so that each kind runs at the TFLOP/s measured whatever peak the planner assumes."""
    from moetrain.config import ConfigError

    split = getattr(flops_per_token, "by_kind", None)
    if split is None:
        raise ConfigError(
            "--gemm-rates: this model's flops_per_token gives no split by kind "
            "(moetrain.models.common.flops.FlopsPerToken)"
        )
    scale = (rates["peak_tflops"] or hw.tflops) / hw.tflops
    missing = [k for k, f in split.items() if f and k not in rates["efficiency"]]
    if missing:
        raise ConfigError(f"--gemm-rates {rates['file']}: no efficiency for {', '.join(missing)}")
    return {k: (f, rates["efficiency"][k] * scale) for k, f in split.items() if f}


def efficiency_text(hw: Hardware, by_kind: dict | None, rates: dict | None) -> str:
    """Where the compute's efficiency came from, for the printed reports: the constant, or
    (with `by_kind` from `rates`) each kind's, the file, and what it measured on."""
    if by_kind is None:
        return f"{hw.tflops:g} TFLOP/s x {hw.efficiency:g}"
    effs = ", ".join(f"{k} {e:.3g}" for k, (_, e) in by_kind.items())
    what = [rates["model"] or "", f"on {rates['device']}" if rates["device"] else ""]
    where = ", ".join([rates["file"], " ".join(w for w in what if w)]).rstrip(", ")
    return f"{hw.tflops:g} TFLOP/s x measured efficiency ({effs}: {where})"


def describe(hw: Hardware) -> dict:
    return asdict(hw)
