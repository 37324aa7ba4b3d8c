"""The attention core: softmax(q k^T * scale) v over a sequence, nothing else.

Projections, norms and RoPE live in the model's attention module; this core is the one
place a parallel plan swaps (context parallelism runs it as a ring) without touching
model code.
"""

import torch
import torch.nn.functional as F
from torch import nn


class AttentionCore(nn.Module):
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, Dv] -> out [B, S, Hq, Dv].

    GQA is native: Hkv may divide Hq, and K/V are never repeated here.
    """

    def __init__(self, scale: float, causal: bool = True) -> None:
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [B, H, S, D]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, causal={self.causal}"
