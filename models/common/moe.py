"""Drop-less mixture of experts: router -> permute by expert -> grouped GEMM -> un-permute.

The routed experts are one module holding stacked `[E, ...]` weights. It takes tokens
already sorted expert-major plus the count per expert, which is the seam expert
parallelism hooks into: a plan wraps `experts` so that the sorted tokens travel to the
rank owning each expert (all-to-all) and back, while this file stays mesh-agnostic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class RouterStats(NamedTuple):
    """What MoE layers saw, for load balancing and logging: [E] for one layer, [L, E] for a
    model's L MoE layers stacked."""

    tokens_per_expert: torch.Tensor  # float, top-k assignments per expert (no grad)
    prob_sum: torch.Tensor  # fp32, router probabilities summed over tokens (has grad)
    num_tokens: int  # tokens each layer routed


@dataclass(frozen=True)
class MoEOptions:
    """Run-time choices of the MoE layers that do not change the weights."""

    gemm: str = "auto"  # see grouped_mm
    capacity_factor: float | None = None  # None: drop-less


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        # NOTE: the CUDA kernel is bf16-only on Hopper-class GPUs and needs rows aligned to
        # 16 bytes; other cases take the loop.
        return (
            x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 8 == 0
        )
    return False


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Per-expert matmul of expert-major rows: x [N, K], w [E, K, M] -> [N, M].

    Rows [offset_e, offset_e + tokens_per_expert[e]) of x are multiplied by w[e].
    impl: "auto" (torch._grouped_mm where the dtype/device allows, else loop), "grouped_mm",
    or "loop" (one matmul per expert: the reference, and the fallback).
    """
    if impl == "auto":
        impl = "grouped_mm" if _grouped_mm_supported(x) else "loop"
    if impl == "grouped_mm":
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    if impl != "loop":
        raise ValueError(f"unknown grouped GEMM impl {impl!r}; use auto, grouped_mm or loop")
    chunks = torch.split(x, tokens_per_expert.tolist())  # host sync: the loop needs sizes
    return torch.cat([chunk @ w[e] for e, chunk in enumerate(chunks)], dim=0)


class TopKRouter(nn.Module):
    """Softmax router in fp32, top-k, optional renormalisation of the top-k weights."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> probs [T, E] fp32, top_weights [T, k] fp32, top_experts [T, k]."""
        probs = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        top_weights, top_experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return probs, top_weights, top_experts


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights, in nn.Linear's (out, in) orientation:
    gate_up_proj [E, 2 * hidden, dim] (gate rows first), down_proj [E, dim, hidden]."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, gemm: str = "auto") -> None:
        super().__init__()
        self.gemm = gemm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted expert-major, tokens_per_expert [E_local] -> [N, dim]."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if isinstance(gate_up, DTensor):
            # NOTE: under expert parallelism the weights are DTensors sharded on the expert
            # dim; the dispatcher already delivered exactly the tokens of the local experts.
            gate_up, down = gate_up.to_local(), down.to_local()
        h = grouped_mm(x, gate_up.transpose(-2, -1), tokens_per_expert, self.gemm)
        gate, up = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), tokens_per_expert, self.gemm)


class MoE(nn.Module):
    """Drop-less token-choice MoE: every token reaches its top-k experts."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        options: MoEOptions | None = None,
    ) -> None:
        super().__init__()
        options = options or MoEOptions()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = options.capacity_factor
        self.gate = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, options.gemm)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, dim]
        probs, top_weights, top_experts = self.gate(x)

        # Permute the T*k (token, expert) assignments expert-major.
        flat_experts = top_experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # assignment ids, expert-major
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)
        stats = RouterStats(tokens_per_expert.detach().float(), probs.sum(dim=0), x.shape[0])
        if self.capacity_factor is not None:
            order, tokens_per_expert = self._drop_over_capacity(order, tokens_per_expert)
        token_of = order // self.top_k  # source token of each sorted assignment

        y_sorted = self.experts(x[token_of], tokens_per_expert)  # [assignments, dim]
        y_sorted = y_sorted * top_weights.reshape(-1)[order, None].to(y_sorted.dtype)
        y = torch.zeros_like(x).index_add_(0, token_of, y_sorted)  # un-permute and sum over k
        return y.reshape(shape), stats

    def _drop_over_capacity(
        self, order: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GShard capacity: each expert keeps its first ceil(cf * T * k / E) assignments in
        token order; the rest are dropped (the residual stream carries those tokens)."""
        capacity = math.ceil(self.capacity_factor * order.numel() / self.num_experts)
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert  # [E]
        expert_of = torch.repeat_interleave(tokens_per_expert)  # expert of each sorted slot
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert_of]
        return order[rank_in_expert < capacity], tokens_per_expert.clamp(max=capacity)


def stack_stats(per_layer: list[RouterStats]) -> RouterStats:
    """Per-layer stats -> one RouterStats with [L, E] tensors."""
    return RouterStats(
        torch.stack([s.tokens_per_expert for s in per_layer]),
        torch.stack([s.prob_sum for s in per_layer]),
        per_layer[0].num_tokens,
    )


def load_balancing_loss(
    stats: RouterStats,
    num_experts: int,
    batch_counts: torch.Tensor | None = None,
    batch_rows: float | None = None,
) -> torch.Tensor:
    """Switch/GShard auxiliary loss, E * sum_e f_e * P_e, over all MoE layers at once.

    f_e is the fraction of (token, top-k slot) assignments that went to expert e and P_e the
    mean router probability of e, both pooled over the layers' tokens as Hugging Face's
    `load_balancing_loss_func` does (so the value matches transformers exactly).

    For a batch spread over ranks, pass `batch_counts` ([E], assignments summed over the
    layers and the ranks) and `batch_rows` (layer-token rows over the ranks): the result is
    this rank's share, and the shares of all ranks sum to the loss of the whole batch
    (the loss is linear in the probabilities, and f carries no gradient).
    """
    layers = stats.prob_sum.shape[0]
    rows = batch_rows if batch_rows is not None else layers * stats.num_tokens
    counts = batch_counts if batch_counts is not None else stats.tokens_per_expert.sum(0)
    return num_experts * torch.sum((counts / rows) * (stats.prob_sum.sum(0) / rows))
