"""Drop-less mixture of experts: router -> permute by expert -> grouped GEMM -> un-permute.

The routed experts are one module holding stacked `[E, ...]` weights. It takes tokens
already sorted expert-major plus the count per expert, which is the seam expert
parallelism hooks into: a plan wraps `experts` so that the sorted tokens travel to the
rank owning each expert (all-to-all) and back, while this file stays mesh-agnostic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class RouterStats(NamedTuple):
    """What one MoE layer saw, for load balancing and logging."""

    tokens_per_expert: torch.Tensor  # [E] float, top-k assignments per expert (no grad)
    prob_sum: torch.Tensor  # [E] fp32, router probabilities summed over tokens (has grad)
    num_tokens: int


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
        gemm: str = "auto",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, gemm)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, dim]
        probs, top_weights, top_experts = self.gate(x)

        # Permute the T*k (token, expert) assignments expert-major.
        flat_experts = top_experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # assignment ids, expert-major
        token_of = order // self.top_k  # [T*k] source token of each sorted assignment
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)

        y_sorted = self.experts(x[token_of], tokens_per_expert)  # [T*k, dim]
        y_sorted = y_sorted * top_weights.reshape(-1)[order, None].to(y_sorted.dtype)
        y = torch.zeros_like(x).index_add_(0, token_of, y_sorted)  # un-permute and sum over k

        stats = RouterStats(tokens_per_expert.detach().float(), probs.sum(dim=0), x.shape[0])
        return y.reshape(shape), stats


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss, E * sum_e f_e * P_e, over all MoE layers at once.

    f_e is the fraction of (token, top-k slot) assignments that went to expert e and P_e the
    mean router probability of e, both pooled over the layers' tokens as Hugging Face's
    `load_balancing_loss_func` does (so the value matches transformers exactly).
    """
    rows = sum(s.num_tokens for s in stats)
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(0)  # [E]
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)  # [E]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))
