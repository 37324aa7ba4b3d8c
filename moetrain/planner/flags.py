"""The planner's own flags (`python -m moetrain.planner`), read and checked before any work:
a count or a figure no machine has is refused with exit 2 naming the flag, instead of a
ZeroDivisionError deep in the estimate (--world-size 0, --ranks-per-node 0) or a plan
that "fits" a negative --gpu-memory. Torch-free, like every refusal of a launch."""

from __future__ import annotations

import math

from moetrain.config import ConfigError

# flags that override the --hardware preset's figures (moetrain.planner.hardware.Hardware)
HW_FLAGS = {
    "--gpu-tflops": "tflops",
    "--efficiency": "efficiency",
    "--intra-gbps": "intra_gbps",
    "--inter-gbps": "inter_gbps",
    "--ranks-per-node": "ranks_per_node",
    "--memory-gbps": "memory_gbps",
    "--gpu-fp8-tflops": "fp8_tflops",
    "--memory-reserve": "reserve_gib",
}

# What each figure means, for the refusal: the fix is a value in its range.
_MEANS = {
    "--gpu-memory": "GiB of memory per GPU, e.g. 80",
    "--gpu-tflops": "the dense bf16 peak per GPU in TFLOP/s, e.g. 989",
    "--efficiency": "the fraction of that peak the kernels reach, in (0, 1], e.g. 0.5",
    "--intra-gbps": "GB/s per GPU inside a node, e.g. 450",
    "--inter-gbps": "GB/s per GPU across nodes, e.g. 50",
    "--memory-gbps": "GB/s of the GPU's memory, e.g. 3350",
    "--gpu-fp8-tflops": "the dense FP8 peak per GPU in TFLOP/s, e.g. 1979",
    "--memory-reserve": "GiB of the GPU's memory kept back for the CUDA context and NCCL "
    "buffers, 0 or more, e.g. 2",
    "--routing-imbalance": "the busiest expert-parallel rank's routed rows over the mean, "
    "1 or more, e.g. 1.1",
}

# figures that may be 0 (the others divide the estimate), and those with a floor above 0
_LEAST = {"--memory-reserve": 0.0, "--routing-imbalance": 1.0}


def count(flag: str, value: str | None, least: int) -> int:
    """A whole number >= `least` (--world-size, --ranks-per-node)."""
    if value is None or not value.isdigit() or int(value) < least:
        raise ConfigError(f"{flag} {value!r}: give a whole number >= {least}")
    return int(value)


def figure(flag: str, value: str) -> float:
    """A finite number > 0 (and <= 1 for --efficiency): every figure the estimate divides
    by; >= 0 for --memory-reserve, >= 1 for --routing-imbalance."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    top = 1.0 if flag == "--efficiency" else math.inf
    least = _LEAST.get(flag)
    above = number > 0 if least is None else number >= least
    if not (math.isfinite(number) and above and number <= top):
        raise ConfigError(f"{flag} {value!r}: give {_MEANS[flag]}")
    return number


def hardware_overrides(flags: dict[str, str | None]) -> dict[str, float | int]:
    """The Hardware fields the flags set, checked."""
    return {
        field: count(flag, flags[flag], 1)
        if field == "ranks_per_node"
        else figure(flag, flags[flag])
        for flag, field in HW_FLAGS.items()
        if flags[flag] is not None
    }
