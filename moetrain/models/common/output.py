"""What a causal LM of this repo returns to the trainer."""

from __future__ import annotations

from typing import NamedTuple

import torch

from moetrain.models.common.moe import RouterStats


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor  # [B, S, vocab]
    # Routing statistics of the MoE layers stacked ([L, B, E]); None without MoE layers. The
    # trainer turns them into the load-balancing loss (per forward, sequence or batch).
    router_stats: RouterStats | None
    # Multi-token prediction: logits of depth k (predicting token i+k+1 at position i), for
    # k = 1..D; None when the model has no MTP modules or was not given their inputs.
    mtp_logits: list[torch.Tensor] | None = None
