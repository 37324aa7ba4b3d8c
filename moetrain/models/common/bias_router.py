"""A softmax router whose experts are chosen with a correction bias that the weights never
see (ERNIE-4.5 MoE's `moe_statics`): the aux-loss-free balancing of the DeepSeek-V3 report
(§2.1.2) on softmax probabilities instead of sigmoid affinities.

Its own file: `moetrain/models/common/moe.py` holds the MoE layer and the routers that came with it.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.common.fp32_linear import fp32_linear
from moetrain.models.common.moe import Routing
from moetrain.models.common.replay import recording


class BiasedSoftmaxRouter(nn.Module):
    """fp32 softmax over the experts; the top-k of (probability + `e_score_correction_bias`)
    are chosen, and their unbiased probabilities, renormalised to sum to 1 (the sum clamped
    below at `norm_min`), are the weights.

    Buffers, the ones the trainer's aux-loss-free bias update looks for (`moe.bias_update_rate`):
    `e_score_correction_bias` [E] (fp32) and `tokens_per_expert` [E] (int64, the assignments
    counted in training forwards since the last update; a replayed forward,
    `moetrain.models.common.replay`, is not counted again).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_min: float = 1e-12) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_min = num_experts, top_k, norm_min
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, dim] -> softmax probabilities [T, E] (what the balance losses read) and the
        top-k experts chosen with the bias, weighted without it."""
        logits = fp32_linear(x, self.weight)  # [T, E]
        probs = logits.softmax(dim=-1)
        # The bias steers selection only: no gradient flows through the choice.
        biased = (probs + self.e_score_correction_bias.float()).detach()
        top_experts = biased.topk(self.top_k, dim=-1).indices  # [T, k]
        top_weights = probs.gather(1, top_experts)
        top_weights = top_weights / top_weights.sum(-1, keepdim=True).clamp(min=self.norm_min)
        if recording(self):  # a training forward, counted once
            with torch.no_grad():
                # NOTE: not bincount, whose output length depends on the data (a
                # torch.compile graph break); index_add_ into [E] is fixed-size.
                chosen = top_experts.flatten()
                self.tokens_per_expert.index_add_(0, chosen, torch.ones_like(chosen))
        ranked = probs.detach().topk(self.top_k, dim=-1).indices  # the unbiased top-k [T, k]
        return Routing(probs, top_weights, top_experts, logits, ranked)
