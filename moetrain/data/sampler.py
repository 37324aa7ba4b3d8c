"""The global sample order: which samples each data-parallel rank reads at each step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from moetrain.data.mixture import BlendedOrder
from moetrain.data.permutation import FeistelPermutation
from moetrain.errors import DataError
from moetrain.parallelisms.dims import grad_accum_steps


@dataclass(frozen=True)
class SampleOrder:
    """The samples a run draws (`dataset`, a PackedDataset) and the order it draws them in,
    with its position (`sampler`): what a checkpoint records of the data."""

    dataset: Any
    sampler: GlobalBatchSampler


class GlobalBatchSampler:
    """Yields this rank's micro-batches (lists of dataset indices), forever.

    The sample stream is epoch 0's order, then epoch 1's, ...; with shuffle, epoch e's order is
    a permutation keyed by (seed, e) that needs no table (`FeistelPermutation`: O(1) memory
    and time per sample, however large the corpus). Step s owns stream positions [s*G, (s+1)*G); rank
    r reads the contiguous slice [r*G/dp, (r+1)*G/dp) of it in micro-batches, in order. Hence
    the samples of a step are the same set for every data-parallel layout.

    All progress lives on this object (not in an iterator): a resumed run loads it
    (`load_state_dict`) and then iterates it again. A checkpoint saves `state_at(consumed)`,
    the position at a step boundary, which is the same on every rank and every layout.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        blend: BlendedOrder | None = None,
    ):
        self.grad_accum = grad_accum_steps(global_batch_size, micro_batch_size, dp_size)
        if num_samples < 1:
            raise DataError(f"need at least one sample, got num_samples={num_samples}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.blend = blend  # [[data.mix]]: the blend decides which sample a position reads
        self.consumed_samples = 0  # global samples of all completed steps
        self.micro_batches_into_step = 0  # micro-batches this rank has read of the current step
        self._order_epoch = -1
        self._order: FeistelPermutation | None = None

    @property
    def step(self) -> int:
        """Index of the step the next micro-batch belongs to (while G stays the same)."""
        return self.consumed_samples // self.global_batch_size

    def _permutation(self, epoch: int) -> FeistelPermutation:
        if epoch != self._order_epoch:  # the current epoch's keys, computed once
            key = f"{self.seed}:{epoch}".encode()
            self._order = FeistelPermutation(self.num_samples, key)
            self._order_epoch = epoch
        return self._order

    def sample_at(self, position: int) -> int:
        """Dataset index at a position of the infinite global stream."""
        epoch, offset = divmod(position, self.num_samples)
        return self._permutation(epoch)[offset] if self.shuffle else offset

    def next_micro_batch(self) -> list[int]:
        per_rank = self.global_batch_size // self.dp_size
        start = (
            self.consumed_samples
            + self.dp_rank * per_rank
            + self.micro_batches_into_step * self.micro_batch_size
        )
        if self.blend is not None:
            batch = self.blend.indices(start, self.micro_batch_size)
        else:
            batch = [self.sample_at(p) for p in range(start, start + self.micro_batch_size)]
        self.micro_batches_into_step += 1
        if self.micro_batches_into_step == self.grad_accum:
            self.consumed_samples += self.global_batch_size
            self.micro_batches_into_step = 0
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_micro_batch()

    def _layout(self) -> dict[str, int]:
        return {
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def state_dict(self) -> dict[str, Any]:
        # At a step boundary nothing here depends on dp_rank, dp_size or the micro-batch size.
        # Mid-step, the position only makes sense for the same layout, which is recorded.
        mid_step = self.micro_batches_into_step > 0
        return {
            "consumed_samples": self.consumed_samples,
            "micro_batches_into_step": self.micro_batches_into_step,
            "mid_step_layout": self._layout() if mid_step else None,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "blend": self.blend.state_at(self.consumed_samples) if self.blend else None,
        }

    def state_at(self, consumed_samples: int) -> dict[str, Any]:
        """The state at the step boundary after `consumed_samples` global samples.

        NOTE: what a checkpoint saves, rather than `state_dict()`: with loader workers the
        sampler runs ahead of training by the micro-batches they prefetched.
        """
        return {
            **self.state_dict(),
            "consumed_samples": consumed_samples,
            "micro_batches_into_step": 0,
            "mid_step_layout": None,
            "blend": self.blend.state_at(consumed_samples) if self.blend else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"the data state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; the sample order would not continue (did "
                    "the data config, its files or train.seed change?)"
                )
        k = int(state["micro_batches_into_step"])
        if k and state.get("mid_step_layout") != self._layout():
            raise DataError(
                f"the data state was saved {k} micro-batches into a step with layout "
                f"{state.get('mid_step_layout')}; resuming mid-step needs that same layout, but "
                f"this run has {self._layout()}. Resume from a step boundary to change layout."
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batches_into_step = k
        if self.blend is not None:
            self.blend.load(state["blend"], self.consumed_samples, same_blend=True)

    def continue_on_other_data(self, state: dict[str, Any]) -> None:
        """`checkpoint.allow_data_change`: keep the global sample count of a checkpoint made
        on other data; a blend starts here, each of its sources that the saved blend also
        had continuing from the samples it had given (new ones from their first)."""
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batches_into_step = 0
        if self.blend is not None:
            saved = state.get("blend") or {"origin": 0, "base": {}, "counts": {}}
            self.blend.load(saved, self.consumed_samples, same_blend=False)
