"""FP8 training (`train.fp8`): the plan's GEMMs swapped for their FP8 forms, from outside.

`apply_float8` runs on the meta model before the parallel plan (as LoRA does), so expert
parallelism, compile, checkpointing and FSDP2 wrap the FP8 forms as they wrap the
originals; the forms hold the same Parameters, so names, checkpoints (master dtype) and
Hugging Face I/O do not change. What runs in FP8 (moetrain/models/common/float8.py,
float8_experts.py):

- every nn.Linear inside the plan's `blocks` (the attention projections, dense MLPs,
  shared experts, DeepSeek-V3's MTP projection), except those under `fp32_modules` (the
  routers) and those with a dimension that is not a multiple of 16, which FP8 GEMM kernels
  do not take (Qwen2-MoE's [1, dim] shared-expert gate, a small MLA projection): they stay
  in the compute dtype, and the start-up note names them;
- the routed experts (`routed_experts`) when they are `GroupedExperts`; other expert
  forms (GPT-OSS's biased, clamped experts) are refused.

The embeddings, norms and the output head lie outside the blocks: compute dtype.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ConfigError
from moetrain.models.common.float8 import E4M3, E5M2, Float8Linear
from moetrain.models.common.float8_experts import Float8GroupedExperts
from moetrain.models.common.moe import GroupedExperts
from moetrain.models.common.plan import ParallelPlan
from moetrain.parallelisms.plan import match_modules

# FP8 GEMM kernels (torch._scaled_mm, _scaled_grouped_mm on CUDA) need both dimensions of
# the weight to be multiples of 16.
FP8_DIM_MULTIPLE = 16


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _block_linears(model: nn.Module, plan: ParallelPlan) -> list[tuple[str, nn.Linear]]:
    """Every nn.Linear inside a block, but those under the plan's fp32 modules (routers)."""
    routers = match_modules(model, plan.fp32_modules, "fp32_modules", required=False)
    under_router = tuple(f"{fqn}." for fqn, _ in routers)
    found = []
    for root, block in match_modules(model, plan.blocks, "blocks", required=False):
        for name, module in block.named_modules():
            fqn = f"{root}.{name}" if name else root
            if isinstance(module, nn.Linear) and not f"{fqn}.".startswith(under_router):
                found.append((fqn, module))
    return found


def fits_fp8(linear: nn.Linear) -> bool:
    return not (linear.in_features % FP8_DIM_MULTIPLE or linear.out_features % FP8_DIM_MULTIPLE)


def apply_float8(
    model: nn.Module,
    plan: ParallelPlan,
    recipe: str,
    model_name: str,
    amax_group: dist.ProcessGroup | None = None,
) -> int:
    """Swap the plan's GEMMs (module docstring) for their FP8 forms under `recipe`
    ("rowwise" | "tensorwise"). `amax_group`: the ranks that each hold a part of one
    micro-batch's tokens (the cp group), over which a tensorwise activation amax is
    reduced; None: one process holds them all. Returns the number of modules swapped."""
    swapped = 0
    for fqn, experts in match_modules(
        model, plan.routed_experts or (), "routed_experts", required=False
    ):
        if type(experts) is not GroupedExperts:
            raise ConfigError(
                f"train.fp8={recipe}: model {model_name!r}'s routed experts "
                f"({type(experts).__name__}, {fqn}) have no FP8 form; set train.fp8=none"
            )
        _swap(model, fqn, Float8GroupedExperts.around(experts, recipe))
        swapped += 1
    for fqn, linear in _block_linears(model, plan):
        if fits_fp8(linear) and type(linear) is nn.Linear:
            _swap(model, fqn, Float8Linear.around(linear, recipe, amax_group))
            swapped += 1
    return swapped


def float8_note(model: nn.Module, plan: ParallelPlan, recipe: str) -> str:
    """The start-up line of what runs in FP8 and which block linears do not (and why)."""
    linears = _block_linears(model, plan)
    fp8 = sum(isinstance(m, Float8Linear) for _, m in linears)
    experts = sum(isinstance(m, Float8GroupedExperts) for m in model.modules())
    kept = [fqn for fqn, m in linears if not isinstance(m, Float8Linear)]
    note = f"train.fp8={recipe}: {fp8} linear layers and {experts} routed-expert modules in FP8"
    if kept:
        shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
        note += (
            f"; {len(kept)} block linear layers stay in the compute dtype (a dimension not a "
            f"multiple of {FP8_DIM_MULTIPLE}): {shown}"
        )
    return note


# The first CUDA compute capabilities with FP8 tensor cores (Ada, Hopper), and the first
# torch._scaled_grouped_mm runs on (Hopper).
FP8_CUDA_CAPABILITY, GROUPED_FP8_CUDA_CAPABILITY = (8, 9), (9, 0)


def fp8_device_problem(
    recipe: str,
    device_type: str,
    capability: tuple[int, int] | None,
    compute_dtype: torch.dtype,
    has_routed_experts: bool,
    torch_ops: Collection[str] | None = None,
) -> str | None:
    """Why `train.fp8=recipe` cannot run on this device and torch (None: it can).
    `capability`: the CUDA device's compute capability (None off CUDA); `torch_ops`: the
    names of the FP8 ops and dtypes this torch has (None: read from torch)."""
    ops = ["float8_e4m3fn", "float8_e5m2", "_scaled_mm"]
    if device_type == "cuda" and has_routed_experts:
        ops.append("_scaled_grouped_mm")
    if torch_ops is None:
        torch_ops = {op for op in ops if hasattr(torch, op)}
    missing = [op for op in ops if op not in torch_ops]
    if missing:
        return (
            f"train.fp8={recipe} needs torch.{', torch.'.join(missing)}, which torch "
            f"{torch.__version__} lacks; upgrade torch or set train.fp8=none"
        )
    if device_type == "cuda":
        need = GROUPED_FP8_CUDA_CAPABILITY if has_routed_experts else FP8_CUDA_CAPABILITY
        if capability is not None and capability < need:
            what = "the routed experts' grouped FP8 GEMM" if has_routed_experts else "FP8 GEMMs"
            return (
                f"train.fp8={recipe}: {what} need a GPU of compute capability "
                f"{need[0]}.{need[1]} or newer, this one is {capability[0]}.{capability[1]}; "
                "set train.fp8=none"
            )
        if compute_dtype != torch.bfloat16:
            return (
                f"train.fp8={recipe} on CUDA computes the GEMMs' outputs in bf16 (the FP8 "
                "kernels' rowwise output), but train.mixed_precision computes in "
                f"{compute_dtype}; set train.mixed_precision=auto or bf16"
            )
        return None
    try:  # elsewhere, whether this build of torch has the kernels: one tiny GEMM of each
        probe = torch.ones(16, 16, device=device_type).to(E4M3)
        one = torch.ones((), device=device_type)
        torch._scaled_mm(probe, probe.t(), one, one, out_dtype=torch.float32)
        rows = torch.ones(16, 1, device=device_type)
        torch._scaled_mm(probe, probe.t(), rows, rows.t(), out_dtype=torch.float32)
        grads = torch.ones(16, 16, device=device_type).to(E5M2)
        torch._scaled_mm(grads, probe.t(), one, one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (
            f"train.fp8={recipe}: torch {torch.__version__} cannot run FP8 GEMMs on "
            f"{device_type} ({first}); set train.fp8=none"
        )
    return None
