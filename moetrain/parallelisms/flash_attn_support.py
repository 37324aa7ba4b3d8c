"""Where flash-attn-4 (`flash_attn.cute`, FlashAttention on NVIDIA's CuTe DSL) can run, and
its import, deferred to the first call (`parallel.cp_kernel=flash_attn`).

One set of rules (`flash_attn_problems`) for the check before launch (moetrain/loop/
preflight.py, with the machine probed and the model's attention shape) and for the kernels
themselves at each call. What version 4.0.0b36 of the package does, read from its
`flash_attn/cute/interface.py`:

- forward and backward on compute capability 9.x (Hopper) and 10.x / 11.x (datacenter
  Blackwell); 8.x has a forward only (no training) and 12.x (consumer Blackwell) runs
  another code path (no sink backward, head dims unchecked) not tried here: both refused;
- bf16 or fp16 inputs (fp8 forward-only): fp32 compute is refused;
- head dims multiples of 8; 8-256 on Hopper; on Blackwell up to 128, or 192/128 (MLA), or
  256/256; GQA with q/k and v head dims apart has no Hopper backward (MLA has no GQA);
- GQA natively (K/V never repeated), sliding windows (`window_size`), packed documents
  through `cu_seqlens` (`flash_attn_varlen_func`), and learnable sinks with their gradient,
  except with head dim 256 on Blackwell;
- a block's log-sum-exp (`return_lse`), and a backward (the private `_flash_attn_bwd`) that
  takes any out and lse: the ring passes its final ones. The pinned version is required
  because that backward is not a public interface.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

import torch

PACKAGE = "flash-attn-4"
VERSION = "4.0.0b36"
CUTLASS = "nvidia-cutlass-dsl"
CUTLASS_VERSION = "4.8.1"
INSTALL = f"pip install {PACKAGE}=={VERSION} {CUTLASS}=={CUTLASS_VERSION}"
KEY = "parallel.cp_kernel=flash_attn"
MAJORS = (9, 10, 11)  # capability majors where it has a forward and backward and checks dims


@dataclass(frozen=True)
class FlashAttnHost:
    """The machine as flash-attn-4 sees it: the device type training runs on, its CUDA
    compute capability (None off CUDA) and the installed versions (None: not installed)."""

    device_type: str
    capability: tuple[int, int] | None
    version: str | None
    cutlass_version: str | None


@dataclass(frozen=True)
class FlashAttnUse:
    """What a run asks of the kernel: the compute dtype, the attention's head dims, whether
    its cores train sinks through the kernel (cp = 1; the ring folds sinks in itself),
    whether ring blocks carry document masks or windows (cp > 1), and whether K/V have
    fewer heads than q (GQA; None: not known before the call, which checks it)."""

    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    sinks: bool = False
    ring_masks: bool = False
    grouped: bool | None = None


@functools.cache
def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def probe_host(device: torch.device) -> FlashAttnHost:
    """The host of `device` (the one training runs on), without importing the package."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return FlashAttnHost(
        device.type, capability, installed_version(PACKAGE), installed_version(CUTLASS)
    )


def _head_dims_problem(major: int, head_dim: int, v_head_dim: int) -> str | None:
    dims = f"head dims {head_dim} (q, k) and {v_head_dim} (v)"
    if head_dim % 8 or v_head_dim % 8 or min(head_dim, v_head_dim) < 8:
        return f"{dims}: flash-attn-4 takes multiples of 8 from 8 up"
    if major == 9 and max(head_dim, v_head_dim) > 256:
        return f"{dims}: flash-attn-4 takes at most 256 on Hopper"
    blackwell = (head_dim <= 128 and v_head_dim <= 128) or (head_dim, v_head_dim) in (
        (192, 128),
        (256, 256),
    )
    if major in (10, 11) and not blackwell:
        return f"{dims}: flash-attn-4 takes up to 128, 192/128 or 256/256 on Blackwell"
    return None


def flash_attn_problems(host: FlashAttnHost, use: FlashAttnUse) -> list[str]:
    """Every reason flash-attn-4 cannot run `use` on `host` (empty: it can), each with its fix."""
    problems = []
    if host.device_type != "cuda":
        problems.append(f"it runs on CUDA only, but training runs on {host.device_type}")
    elif host.capability is not None and host.capability[0] not in MAJORS:
        major, minor = host.capability
        why = (
            "before Hopper it has a forward only, no backward"
            if major < 9
            else "its path for consumer Blackwell is not validated here"
        )
        problems.append(
            f"this GPU has compute capability {major}.{minor}; flash-attn-4 trains on 9.x "
            f"(Hopper) and 10.x/11.x (Blackwell) only ({why})"
        )
    if host.version is None:
        problems.append(f"{PACKAGE} is not installed")
    elif host.version != VERSION:
        problems.append(
            f"{PACKAGE} {host.version} is installed, but the ring calls the backward of "
            f"{VERSION} (not a public interface)"
        )
    if host.version is not None and host.cutlass_version is None:  # installed without deps
        problems.append(f"{CUTLASS} (its CuTe DSL) is not installed")
    if use.dtype not in (torch.bfloat16, torch.float16):
        problems.append(
            f"attention would compute in {str(use.dtype).removeprefix('torch.')}, and "
            "flash-attn-4 takes bf16/fp16 only: set train.mixed_precision=bf16"
        )
    major = host.capability[0] if host.capability is not None else None
    if major in MAJORS:
        dims = _head_dims_problem(major, use.head_dim, use.v_head_dim)
        if dims is not None:
            problems.append(dims)
        if major == 9 and use.grouped and use.head_dim != use.v_head_dim:
            problems.append(
                f"GQA with head dims {use.head_dim} (q, k) and {use.v_head_dim} (v): "
                "flash-attn-4's Hopper backward takes GQA with one head dim only"
            )
        if use.sinks and major in (10, 11) and (use.head_dim, use.v_head_dim) == (256, 256):
            problems.append(
                "the attention sinks would get no gradient: flash-attn-4 has no sink "
                "backward with head dim 256 on Blackwell; use parallel.cp_kernel=auto (flex)"
            )
    if use.ring_masks:
        problems.append(
            "the context-parallel ring's blocks carry document masks or sliding windows, "
            "which its block calls here do not express (a window's band in an off-diagonal "
            "block is offset by the blocks' positions); use parallel.cp_kernel=flex (or auto)"
        )
    return problems


def refusal(problems: list[str]) -> str:
    """One message for `flash_attn_problems`: the key, each problem, the install command."""
    return (
        f"{KEY} cannot run here: {'; '.join(problems)}. flash-attn-4 installs with "
        f"`{INSTALL}`; parallel.cp_kernel=auto runs without it"
    )


@functools.cache
def host_of(device: torch.device) -> FlashAttnHost:
    """`probe_host`, once per device (the kernels ask at every call)."""
    return probe_host(device)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: bool = False) -> None:
    """At a kernel's call: refuse what `flash_attn_problems` refuses, for q [B, S, Hq, D],
    k [B, S, Hkv, D], v [B, S, Hkv, Dv] (ValueError naming the key, the problems and the
    install command)."""
    grouped = q.shape[-2] != k.shape[-2]
    use = FlashAttnUse(q.dtype, q.shape[-1], v.shape[-1], sinks=sinks, grouped=grouped)
    problems = flash_attn_problems(host_of(q.device), use)
    if problems:
        raise ValueError(refusal(problems))


def interface() -> ModuleType:
    """`flash_attn.cute.interface`, imported at the first call: it loads the CuTe DSL (and
    CUDA libraries), which a run that does not ask for the kernel should never pay for."""
    try:
        from flash_attn.cute import interface as fa_interface
    except (ImportError, OSError, RuntimeError) as err:  # absent, or its CUDA libraries
        raise RuntimeError(
            f"{KEY}: flash-attn-4 does not import ({err}); install it with `{INSTALL}`"
        ) from err
    return fa_interface


def import_problem() -> str | None:
    """Why flash-attn-4 cannot be imported here (None: it can); for tests and benchmarks."""
    try:
        interface()
    except RuntimeError as err:
        return str(err)
    return None
