"""The attention core: softmax(q k^T * scale) v over a sequence, nothing else.

Projections, norms and RoPE live in the model's attention module; this core is the one
place a parallel plan swaps (context parallelism runs it as a ring) without touching
model code.
"""

import torch
import torch.nn.functional as F
from torch import nn


def block_mask(
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Which queries see which keys: q_ids [B, nq], k_ids [B, nk] document ids, q_pos [nq],
    k_pos [nk] global positions -> [B, nq, nk] bool (same document, key not after query)."""
    mask = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    return mask


def document_mask(document_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """document_ids [B, S] -> [B, 1, S, S] bool, True where query i may see key j: same
    document (and j <= i if causal). Every query sees at least itself."""
    positions = torch.arange(document_ids.shape[1], device=document_ids.device)
    return block_mask(document_ids, document_ids, positions, positions, causal)[:, None]


class AttentionCore(nn.Module):
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, Dv] -> out [B, S, Hq, Dv].

    GQA is native: Hkv may divide Hq, and K/V are never repeated here (but see the masked
    path on accelerators). `document_ids` [B, S] (packed documents): a query sees only the
    keys of its own document; None is plain (causal) attention, unchanged.
    """

    def __init__(self, scale: float, causal: bool = True) -> None:
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [B, H, S, D]
        gqa = k.shape[1] != q.shape[1]
        if document_ids is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, scale=self.scale, enable_gqa=gqa
            )
            return out.transpose(1, 2)
        mask = document_mask(document_ids, self.causal)  # [B, 1, S, S]
        if gqa and q.device.type != "cpu":
            # NOTE: SDPA's CUDA kernel for arbitrary masks (memory-efficient attention) does
            # not take GQA; without the repeat it would fall back to the math path.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, causal={self.causal}"
