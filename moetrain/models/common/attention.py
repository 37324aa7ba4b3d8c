"""The attention core: softmax(q k^T * scale) v over a sequence, nothing else.

Projections, norms and RoPE live in the model's attention module; this core is the one
place a parallel plan swaps (context parallelism runs it as a ring) without touching
model code. Its variants, stated by the model per layer:

- `causal`: a query sees keys at or before its position;
- `window` (sliding-window attention): ... and fewer than `window` positions before it;
- document ids (packed samples, `data.document_mask`): ... and of its own document;
- `sinks` [Hq] (attention sinks, GPT-OSS): a learned logit per head that joins every
  softmax denominator, as a key each query sees whose value is zero.

The visibility rules are one function, `block_mask` (moetrain/models/common/visibility.py), used by
this plain path and by the ring's block schedule (moetrain/parallelisms/cp_schedule.py) alike;
`Visibility` describes them for a block without materialising the [Sq, Sk] mask.

On CUDA, a masked core (documents, window or sinks) runs FlexAttention
(moetrain/models/common/flex.py): no dense [S, S] mask, memory O(S). On CPU it runs SDPA with the
dense mask, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.common.flex import flex_attention_core
from moetrain.models.common.visibility import document_mask


def _with_sinks(q, k, v, mask, sinks, scale):
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D*], mask [B, 1, Sq, Sk], sinks [Hq] -> the same
    attention with each head's sink in its softmax denominator, as one SDPA call.

    NOTE: a sink is a key every query sees, with score `sinks[h]` and value 0. Each query
    head of a KV group gets one extra dimension (one-hot for q, 0 for the real keys), and
    the sink key holds sinks[h] / scale in head h's dimension: q.k is unchanged for the
    real keys and equals the sink for the sink key. So the fused kernels (memory O(S), not
    O(S^2)) compute it, and autograd gives the sinks' gradient through the key."""
    b, hq, s, d = q.shape
    hkv, group = k.shape[1], hq // k.shape[1]
    one_hot = torch.eye(group, dtype=q.dtype, device=q.device).repeat(hkv, 1)  # [Hq, G]
    q = torch.cat([q, one_hot[None, :, None].expand(b, hq, s, group)], dim=-1)
    k = F.pad(k, (0, group))  # [B, Hkv, S, D + G], zeros in the extra dims
    sink_key = F.pad(sinks.to(q.dtype).view(hkv, group) / scale, (d, 0)).view(hkv, 1, d + group)
    k = torch.cat([k, sink_key[None].expand(b, hkv, 1, d + group)], dim=2)
    v = torch.cat([v, v.new_zeros(b, hkv, 1, v.shape[-1])], dim=2)
    mask = F.pad(mask, (0, 1), value=True)  # every query sees its sink
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != hq
    )


def sdpa_attention(q, k, v, document_ids, causal, window, scale, sinks=None):
    """SDPA with a dense [B, 1, S, S] mask for documents and windows (the CPU path, and
    CUDA's before FlexAttention: memory O(S^2)): q [B, Hq, S, D], k/v [B, Hkv, S, D*]."""
    mask = None
    if document_ids is not None or window is not None:
        if document_ids is None:  # one document: the window alone
            document_ids = q.new_zeros(q.shape[0], q.shape[2], dtype=torch.int64)
        mask = document_mask(document_ids, causal, window)  # [B, 1, S, S]
    elif sinks is not None:  # the sink joins a mask: the causal one, or every key
        mask = torch.ones(1, 1, q.shape[2], q.shape[2], dtype=torch.bool, device=q.device)
        mask = mask.tril() if causal else mask
    if mask is None:
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    return masked_attention(q, k, v, mask, scale, sinks)


def masked_attention(q, k, v, mask, scale, sinks=None):
    """SDPA of q [B, Hq, Sq, D] over k/v [B, Hkv, Sk, D*] where a bool mask [B or 1, 1, Sq,
    Sk] says which keys each query sees (at least one each), with each head's sink [Hq]
    in its softmax denominator when `sinks` is given. The one masked path of the plain core
    and of generation's cached core (moetrain/generate/kv_cache.py), whose queries are the
    newest positions of a longer sequence of keys."""
    if sinks is not None:
        return _with_sinks(q, k, v, mask, sinks, scale)
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.device.type != "cpu":
        # NOTE: SDPA's CUDA kernel for arbitrary masks (memory-efficient attention) does
        # not take GQA; without the repeat it would fall back to the math path.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class AttentionCore(nn.Module):
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, Dv] -> out [B, S, Hq, Dv].

    GQA is native: Hkv may divide Hq, and K/V are never repeated here (but see the masked
    path on accelerators). `document_ids` [B, S] (packed documents): a query sees only the
    keys of its own document; None is plain (causal) attention, unchanged.
    """

    def __init__(self, scale: float, causal: bool = True, window: int | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sinks [Hq] (or None): each head's sink logit (see the module doc)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [B, H, S, D]
        masked = document_ids is not None or self.window is not None or sinks is not None
        attend = flex_attention_core if masked and q.is_cuda else sdpa_attention
        out = attend(q, k, v, document_ids, self.causal, self.window, self.scale, sinks)
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"scale={self.scale:.4g}, causal={self.causal}{window}"
