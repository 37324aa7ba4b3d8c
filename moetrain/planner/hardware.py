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
    memory_gib: float  # what the GPU exposes (its "80 GB" is less: MEMORY_RESERVE)
    # GB/s of the GPU's memory (HBM): what the optimizer step, which streams the state,
    # runs at (`step_cost.optimizer_seconds`)
    memory_gbps: float = 3350.0
    fp8_tflops: float = 0.0  # dense FP8 peak per GPU (e4m3 x e4m3, fp32 accumulate); 0: none
    reserve_gib: float = 2.0  # of memory_gib, what the training state cannot have (RESERVE)


# NOTE: of what a GPU exposes, the caching allocator does not get all. The CUDA context
# (the driver's and the loaded kernels' code, about 0.5-1 GiB on Hopper with torch's lazy
# module loading), cuBLAS' and cuDNN's workspaces, and NCCL's buffers (per communicator and
# peer, a few MiB per channel: with FSDP, EP (64 peers), PP and DP groups of 2,048 ranks
# about 1 GiB or more) sit outside it. The planner keeps 2 GiB back (`--memory-reserve`):
# the usable memory is memory_gib - reserve_gib.
RESERVE_TEXT = "CUDA context and workspaces ~0.75, NCCL buffers ~1.25"

# What an "80 GB" H100 / H800 and a "141 GB" H200 expose: 81,559 and 143,771 MiB
# (nvidia-smi's total; torch.cuda.mem_get_info's is the same), 79.6 and 140.4 GiB.
_EXPOSED_80GB, _EXPOSED_141GB = 81559 / 1024, 143771 / 1024

# Dense peaks per GPU from NVIDIA's datasheets, which state them with 2:4 sparsity (twice
# dense): H100 SXM and H200 SXM BF16 1,979 and FP8 3,958 TFLOPS with sparsity, so 989 and
# 1,979 dense; the H800 SXM is the H100's compute (its NVLink is cut): the same figures.
_BF16, _FP8 = 989, 1979

PRESETS = {
    # 8 x H100 SXM: NVLink 4 (900 GB/s both ways), one 400 Gb/s NIC per GPU, HBM3 3.35 TB/s
    "h100": Hardware(
        "8 x H100 SXM, NVLink 4, 8 x 400 Gb/s", _BF16, 0.5, 450, 50, 8, _EXPOSED_80GB, 3350, _FP8
    ),
    # 8 x H200 SXM: the same compute and links, more and faster memory (HBM3e 4.8 TB/s)
    "h200": Hardware(
        "8 x H200 SXM, NVLink 4, 8 x 400 Gb/s", _BF16, 0.5, 450, 50, 8, _EXPOSED_141GB, 4800, _FP8
    ),
    # DeepSeek-V3's cluster, as its report states it (section 3.2.2): NVLink 160 GB/s per
    # GPU usable (of the nominal 200 per direction), InfiniBand 50 GB/s per GPU (400 Gb/s);
    # the H800's HBM3 is the H100's, 3.35 TB/s
    "h800": Hardware(
        "8 x H800, NVLink 160 GB/s usable, IB 50 GB/s (DeepSeek-V3 report)",
        _BF16,
        0.5,
        160,
        50,
        8,
        _EXPOSED_80GB,
        3350,
        _FP8,
    ),
}


def usable_gib(hw: Hardware, exposed: float | None = None) -> float:
    """GiB the training state may take: what the GPU exposes (`exposed`, default the
    preset's) less the reserve for the context and communication buffers."""
    return (hw.memory_gib if exposed is None else exposed) - hw.reserve_gib


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
