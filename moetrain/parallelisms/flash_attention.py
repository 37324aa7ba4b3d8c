"""flash-attn-4 as the attention core without context parallelism (`parallel.cp_kernel=
flash_attn` at cp = 1): each attention core the model's plan names is swapped for a
`FlashAttentionCore`, as context parallelism swaps them for its ring; the model's own
modules compute everything else, and the core keeps the replaced one's scale, causal flag
and sliding window.

- plain (causal) attention: `flash_attn_func`, GQA native (K/V never repeated);
- packed documents: `flash_attn_varlen_func` over the B * S tokens laid end to end, each
  document one sequence (`cu_seqlens`, built on the device from the document ids; no
  [S, S] mask). Documents never cross rows: a row's start begins one;
- a sliding window: `window_size` (left = window - 1; right = 0 when causal);
- sinks [Hq]: `learnable_sink`, which the kernel trains (its backward returns their
  gradient; `flash_attn_support` refuses the head dims where it does not).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.parallelisms.flash_attn_support import check_inputs, interface


def cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, S] -> int32 [n + 1]: where each of the n documents starts among the
    B * S tokens laid end to end, then B * S. A document is a run of equal ids in a row (the
    packer numbers them in order); each row starts a new one.

    NOTE: one host sync, the count of documents, which sizes the kernel's grid (padding the
    offsets to a fixed count would launch a tile per empty slot)."""
    batch, seq = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()
    return torch.cat([offsets, offsets.new_full((1,), batch * seq)]).to(torch.int32)


def window_size(causal: bool, window: int | None) -> tuple[int | None, int | None]:
    """A core's window as flash-attn-4's (left, right): query i sees keys i - left .. i + right
    (None: unbounded), ours sees keys fewer than `window` positions away."""
    if window is None:
        return None, None
    return window - 1, 0 if causal else window - 1


class DocumentSpans:
    """The `cu_seqlens` of the document ids the model's cores were last given, shared by
    the cores `apply_flash_attention` installs: every layer of a forward (and a checkpointed
    replay) gets the same ids tensor, so its one host sync happens once per micro-batch,
    not once per layer. A new tensor, or the same one written in place, is computed anew."""

    def __init__(self) -> None:
        self._ids: weakref.ref | None = None
        self._version = -1
        self._offsets: torch.Tensor | None = None

    def of(self, document_ids: torch.Tensor) -> torch.Tensor:
        held = self._ids() if self._ids is not None else None
        if held is not document_ids or self._version != document_ids._version:
            self._offsets = cu_seqlens(document_ids)
            self._ids, self._version = weakref.ref(document_ids), document_ids._version
        return self._offsets


class FlashAttentionCore(nn.Module):
    """Drop-in for `moetrain.models.common.attention.AttentionCore` through flash-attn-4:
    q [B, S, Hq, D], k/v [B, S, Hkv, D*] (bf16/fp16, on Hopper or datacenter Blackwell)
    -> out [B, S, Hq, Dv]."""

    def __init__(
        self, scale: float, causal: bool, window: int | None, spans: DocumentSpans
    ) -> None:
        super().__init__()
        self.scale, self.causal, self.window = scale, causal, window
        self.spans = spans

    # NOTE: under train.compile the core runs eagerly (a graph break): flash-attn-4 is an
    # autograd Function over its own compiled CuTe kernels, nothing dynamo can trace.
    @torch.compiler.disable
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `AttentionCore.forward`: document_ids [B, S] or None, sinks [Hq] or None."""
        if isinstance(sinks, DTensor):
            sinks = sinks.full_tensor()
        check_inputs(q, k, v, sinks=sinks is not None)
        fa = interface()
        common = dict(
            softmax_scale=self.scale,
            causal=self.causal,
            window_size=window_size(self.causal, self.window),
            learnable_sink=sinks,
        )
        if document_ids is None:
            out, _ = fa.flash_attn_func(q, k, v, **common)
            return out
        batch, seq = q.shape[:2]
        offsets = self.spans.of(document_ids)
        out, _ = fa.flash_attn_varlen_func(
            *(t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)),
            cu_seqlens_q=offsets,
            cu_seqlens_k=offsets,
            max_seqlen_q=seq,  # a bound: no document is longer than its row
            max_seqlen_k=seq,
            **common,
        )
        return out.view(batch, seq, *out.shape[1:])

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"scale={self.scale:.4g}, causal={self.causal}{window}, kernel=flash_attn"


def apply_flash_attention(
    model: nn.Module, cores: list[tuple[str, nn.Module]]
) -> list[FlashAttentionCore]:
    """Replace each attention core (from the plan) by a `FlashAttentionCore`; returns them.
    Parameter names do not change: a core holds no parameter."""
    spans = DocumentSpans()
    installed = []
    for fqn, core in cores:
        parent_name, _, child = fqn.rpartition(".")
        flash = FlashAttentionCore(core.scale, core.causal, core.window, spans)
        setattr(model.get_submodule(parent_name), child, flash)
        installed.append(flash)
    return installed
