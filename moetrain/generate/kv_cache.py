"""A KV cache applied from outside the model, as context parallelism applies its ring: each
attention core the model's plan names (`ParallelPlan.attention_core`) is swapped, for the
time of a generation, for a `CachedAttention` that keeps its layer's keys and values and
attends the new queries against them. The model's own modules still compute everything
else (projections, norms, RoPE from position_ids, MLA's expansion, GPT-OSS's sinks); the
core keeps the replaced one's scale, causal flag and sliding window.

Left-padded batches: the model is given document ids, 1 for a prompt's or an answer's
token and 0 for padding, which it passes to every core call (the models' contract for
packed documents). The cached core keeps them with its keys, and a query sees the keys of
its own "document" (`moetrain.models.common.visibility.block_mask`): a real token never sees a pad,
a pad sees pads only (its output is never read). Causality and windows count cache slots,
which are positions within a row's real tokens, since those are contiguous.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moetrain.models.common.attention import AttentionCore, masked_attention
from moetrain.models.common.plan import ParallelPlan
from moetrain.models.common.visibility import block_mask
from moetrain.parallelisms.plan import match_modules


class CachedAttention(nn.Module):
    """Drop-in for `AttentionCore` at generation: q [B, S, Hq, D], k/v [B, S, Hkv, D*] of
    the S newest positions -> out [B, S, Hq, Dv], attending over every position so far.

    Keys, values and document ids live in buffers of `capacity` positions, allocated at the
    first call after `start` (their shapes and dtype are the model's)."""

    def __init__(self, scale: float, causal: bool, window: int | None) -> None:
        super().__init__()
        self.scale, self.causal, self.window = scale, causal, window
        self.capacity = 0
        self.length = 0  # positions held
        self.keys: torch.Tensor | None = None  # [B, capacity, Hkv, D]
        self.values: torch.Tensor | None = None  # [B, capacity, Hkv, Dv]
        self.key_ids: torch.Tensor | None = None  # [B, capacity]: 1 real, 0 padding

    def start(self, capacity: int) -> None:
        """Forget what is held; the next call starts a sequence of at most `capacity`."""
        self.capacity, self.length = capacity, 0
        self.keys = self.values = self.key_ids = None

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` [n] (int64): finished answers leave the batch."""
        if self.keys is not None:
            self.keys, self.values, self.key_ids = (
                t.index_select(0, rows) for t in (self.keys, self.values, self.key_ids)
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, new = q.shape[:2]
        if document_ids is None:  # no padding: every position is real
            document_ids = torch.ones(batch, new, dtype=torch.int64, device=q.device)
        if self.keys is None:
            self.keys = k.new_empty(batch, self.capacity, *k.shape[2:])
            self.values = v.new_empty(batch, self.capacity, *v.shape[2:])
            self.key_ids = document_ids.new_zeros(batch, self.capacity)
        begin, end = self.length, self.length + new
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions given position {end}")
        self.keys[:, begin:end], self.values[:, begin:end] = k, v
        self.key_ids[:, begin:end] = document_ids
        self.length = end
        slots = torch.arange(end, device=q.device)
        mask = block_mask(
            document_ids, self.key_ids[:, :end], slots[begin:], slots, self.causal, self.window
        )  # [B, new, end]
        keys, values = self.keys[:, :end], self.values[:, :end]
        out = masked_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            mask[:, None],
            self.scale,
            sinks,
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"scale={self.scale:.4g}, causal={self.causal}{window}, capacity={self.capacity}"


class KVCache:
    """The cached cores installed in a model (`cached_attention`), one per attention core."""

    def __init__(self, cores: list[CachedAttention]) -> None:
        self.cores = cores

    def start(self, capacity: int) -> None:
        for core in self.cores:
            core.start(capacity)

    def keep(self, rows: torch.Tensor) -> None:
        for core in self.cores:
            core.keep(rows)


@contextmanager
def cached_attention(model: nn.Module, plan: ParallelPlan) -> Iterator[KVCache]:
    """Within the block, every attention core of `model` that `plan` names is a
    `CachedAttention`; the model's own cores are back afterwards, whatever happened.

    NOTE: a non-causal core is refused: a new token would change what the earlier
    positions see, which a cache of their keys and values cannot reproduce."""
    if plan.attention_core is None:
        raise ValueError(f"{type(model).__name__}'s plan names no attention core to cache")
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    cores = []
    try:
        for fqn, core in match_modules(model, plan.attention_core, "attention_core"):
            if not isinstance(core, AttentionCore) or not core.causal:
                raise ValueError(
                    f"{fqn} ({core}) is not a causal AttentionCore: cached decoding cannot run it"
                )
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            cores.append(CachedAttention(core.scale, core.causal, core.window))
            setattr(parent, child, cores[-1])
            swapped.append((parent, child, core))
        yield KVCache(cores)
    finally:
        for parent, child, core in swapped:
            setattr(parent, child, core)
