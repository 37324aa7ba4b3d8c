"""LoRA: a frozen weight W plus a trained low-rank update, W + (alpha / r) * B @ A.

A [r, in] and B [out, r] in nn.Linear's (out, in) orientation; B starts at zero, so a model
with fresh adapters computes exactly what its base does. Two forms:

- `LoRALinear`: an nn.Linear (attention projections, shared experts) with `lora_A`, `lora_B`;
- `LoRAGroupedExperts`: routed experts with each stacked weight's adapters stacked per
  expert beside it (`gate_up_lora_A` [E, r, dim], `gate_up_lora_B` [E, 2 * hidden, r],
  `down_lora_A` [E, r, hidden], `down_lora_B` [E, dim, r]): expert parallelism shards them
  on dim 0 with their base, and the dispatcher's tokens meet their own expert's adapters.

Each LoRA module computes its base alone while its `adapters_enabled` is False: the frozen
base, without a second copy (DPO's reference; switched from outside by
`moetrain.build.lora.adapters_disabled`).

The base weights keep their names (`q_proj.weight`, `experts.gate_up_proj`): Hugging Face
import and export, the plans and the initialisation see the model they know; `is_adapter`
tells the adapters apart. Which modules get adapters, and freezing the rest, is the
trainer's (`moetrain/build/lora.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.models.common.grouped_gemm import grouped_mm
from moetrain.models.common.moe import GroupedExperts

ADAPTER_SUFFIXES = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (a dotted path) is a LoRA adapter."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.adapters_enabled = True  # False: the base alone (see the module)

    @classmethod
    def around(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRALinear holding `linear`'s own weight and bias (the same Parameters)."""
        with torch.device(linear.weight.device):
            new = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                rank,
                alpha,
                dropout,
            )
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return base
        low_rank = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return base + self.scale * low_rank


class LoRAGroupedExperts(GroupedExperts):
    """GroupedExperts whose two stacked projections each carry per-expert adapters."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        gemm: str = "auto",
    ) -> None:
        super().__init__(num_experts, dim, hidden_dim, gemm)
        self.scale = alpha / rank
        self.gate_up_lora_A = nn.Parameter(torch.empty(num_experts, rank, dim))
        self.gate_up_lora_B = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, rank))
        self.down_lora_A = nn.Parameter(torch.empty(num_experts, rank, hidden_dim))
        self.down_lora_B = nn.Parameter(torch.empty(num_experts, dim, rank))
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.adapters_enabled = True  # False: the base alone (see the module)

    @classmethod
    def around(
        cls, experts: GroupedExperts, rank: int, alpha: float, dropout: float
    ) -> LoRAGroupedExperts:
        E, two_hidden, dim = experts.gate_up_proj.shape
        with torch.device(experts.gate_up_proj.device):
            new = cls(E, dim, two_hidden // 2, rank, alpha, dropout, experts.gemm)
        new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
        return new

    def project(self, x: torch.Tensor, name: str, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        base = super().project(x, name, tokens_per_expert)
        if not self.adapters_enabled:
            return base
        a, b = (_local(getattr(self, f"{name}_lora_{s}")) for s in "AB")
        t = grouped_mm(self.lora_dropout(x), a.transpose(-2, -1), tokens_per_expert, self.gemm)
        return base + self.scale * grouped_mm(t, b.transpose(-2, -1), tokens_per_expert, self.gemm)


def adapted_weights(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """{base weight name: (its A's name, its B's name, alpha / r)} of every adapted weight."""
    out = {}
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        if isinstance(module, LoRALinear):
            out[f"{prefix}weight"] = (f"{prefix}lora_A", f"{prefix}lora_B", module.scale)
        elif isinstance(module, LoRAGroupedExperts):
            for w in ("gate_up", "down"):
                names = (f"{prefix}{w}_lora_A", f"{prefix}{w}_lora_B", module.scale)
                out[f"{prefix}{w}_proj"] = names
    return out


@torch.no_grad()
def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32, back in W's dtype (batched over experts for [E, ...])."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
