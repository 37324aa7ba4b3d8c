"""What the data path hands the trainer: a `Batch` of [B, S] tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

# Label value that the loss ignores (torch.nn.functional.cross_entropy's default ignore_index).
IGNORE_INDEX = -100


@dataclass(frozen=True, eq=False)  # tensors have no single truth value
class Batch:
    """One micro-batch (or one sample, without the leading B). Every field is [B, S] int64
    except the MTP ones, [B, S, D]; all share the sequence dim 1, which context
    parallelism splits."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # input_ids shifted left by one (IGNORE_INDEX: no target)
    position_ids: torch.Tensor  # true positions, kept through any reordering of the sequence
    document_ids: torch.Tensor  # index of the packed document each token belongs to
    # Multi-token prediction (see moetrain.loop.losses.with_mtp_targets): depth k's input and
    # label at position i are token i+k and label i+k.
    mtp_input_ids: torch.Tensor | None = None
    mtp_labels: torch.Tensor | None = None
    # parallel.cp_layout=balanced: the chunks each cp rank holds of this micro-batch
    # ([cp, k], moetrain.parallelisms.cp_schedule.balanced_table), set by the split; not a sequence
    cp_table: torch.Tensor | None = field(default=None, metadata={"sequence": False})

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """`fn` applied to every sequence tensor present."""
        return replace(
            self,
            **{
                f.name: fn(t)
                for f in fields(self)
                if f.metadata.get("sequence", True) and (t := getattr(self, f.name)) is not None
            },
        )

    def to(self, device: torch.device) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=True))

    @staticmethod
    def stack(samples: list[Batch]) -> Batch:
        """Samples ([S] tensors) -> one micro-batch ([B, S] tensors)."""
        names = [f.name for f in fields(Batch) if getattr(samples[0], f.name) is not None]
        return Batch(**{n: torch.stack([getattr(s, n) for s in samples]) for n in names})
