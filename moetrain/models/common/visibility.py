"""Which queries see which keys: the visibility rules of `moetrain.models.common.attention`, one
function (`block_mask`) for the plain core and the ring's block schedule alike, and their
description for one block (`Visibility`), which FlexAttention reads without the mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_mask(
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Which queries see which keys: q_ids [B, nq], k_ids [B, nk] document ids, q_pos [nq],
    k_pos [nk] global positions -> [B, nq, nk] bool: same document, key not after the
    query (causal), and fewer than `window` positions away (sliding window)."""
    mask = q_ids[:, :, None] == k_ids[:, None, :]
    distance = q_pos[:, None] - k_pos[None, :]  # [nq, nk]
    if causal:
        mask = mask & (distance >= 0)
    if window is not None:
        mask = mask & (distance.abs() < window)
    return mask


@dataclass(frozen=True)
class Visibility:
    """`block_mask`'s inputs for one (query block x key block): which queries see which
    keys, described. q_ids [B, Sq], k_ids [B, Sk] document ids; q_pos [Sq], k_pos [Sk]
    global positions."""

    q_ids: torch.Tensor
    k_ids: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    causal: bool
    window: int | None = None

    def dense(self) -> torch.Tensor:
        """[B, Sq, Sk] bool (O(Sq * Sk) memory: the math kernels' form)."""
        return block_mask(self.q_ids, self.k_ids, self.q_pos, self.k_pos, self.causal, self.window)


def dense_mask(mask: Visibility | torch.Tensor | None) -> torch.Tensor | None:
    """A block's mask as [B, Sq, Sk] bool, whether described or already dense (or None)."""
    return mask.dense() if isinstance(mask, Visibility) else mask


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where each document starts (`data.reset_positions`):
    document_ids [..., S] -> [..., S] int64, the index of each token within its document."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    # The index of the latest start at or before each token, carried forward by cummax.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def document_mask(
    document_ids: torch.Tensor, causal: bool, window: int | None = None
) -> torch.Tensor:
    """document_ids [B, S] -> [B, 1, S, S] bool, True where query i may see key j
    (`block_mask`). Every query sees at least itself."""
    positions = torch.arange(document_ids.shape[1], device=document_ids.device)
    return block_mask(document_ids, document_ids, positions, positions, causal, window)[:, None]
