"""`[[data.mix]]`: prepared corpora blended by weight into one global sample order.

Invariant: after n samples of a blend, each source has given within one sample of its share
w_i * n, and the order is a function of the seed, the weights and the sources' sizes only,
so every rank computes the same global batch whatever the layout, and a resume continues it.

The interleave (as Megatron's blended datasets build theirs): position n goes to the source
furthest behind its share, argmax_i (w_i * (n + 1) - c_i(n)), ties to the first source.
Megatron keeps the whole interleave as a table; here it is recomputed a global batch at a
time from the counts at the batch's start, which the sampler keeps for the step boundaries
it has passed (a checkpoint saves them): memory O(number of sources), no per-sample table.
Each source walks its own samples in its own shuffled epochs (a `FeistelPermutation` keyed
by the seed, the source's name and its epoch), and starts its next epoch on its own.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from moetrain.data.batch import Batch
from moetrain.data.permutation import FeistelPermutation
from moetrain.errors import DataError

_KEPT_BOUNDARIES = 64  # step boundaries whose counts are remembered (loader prefetch < this)


def interleave(weights: list[float], counts: list[int], start: int, length: int) -> list[int]:
    """The sources of blend positions [start, start + length), given `counts` (samples each
    source gave before `start`; updated in place). Weights sum to 1."""
    sources = []
    for n in range(start, start + length):
        deficits = [w * (n + 1) - c for w, c in zip(weights, counts, strict=True)]
        i = deficits.index(max(deficits))
        counts[i] += 1
        sources.append(i)
    return sources


def weight_changes(saved: dict[str, float], ours: dict[str, float]) -> list[str]:
    """What differs between two blends' normalised weights by source name, e.g. 'web: weight
    0.5 -> 0.6', each pair with as many digits as it takes to tell them apart."""
    changes = []
    for name in [*saved, *(k for k in ours if k not in saved)]:
        if name not in ours:
            changes.append(f"{name}: removed (weight was {saved[name]!r})")
        elif name not in saved:
            changes.append(f"{name}: added (weight {ours[name]!r})")
        elif saved[name] != ours[name]:
            old, new = _apart(saved[name], ours[name])
            changes.append(f"{name}: weight {old} -> {new}")
    return changes


def _apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with the fewest significant digits (3 or more) that differ; 17 always do."""
    for digits in range(3, 17):
        if f"{a:.{digits}g}" != f"{b:.{digits}g}":
            break
    else:
        digits = 17
    return f"{a:.{digits}g}", f"{b:.{digits}g}"


class BlendedOrder:
    """Which dataset index each position of the global sample stream reads, for a blend.

    Dataset indices are those of `MixtureDataset`: source i's samples follow source i-1's.
    `origin` is the stream position where this blend began (0, or where a resume changed the
    blend on purpose), `base` the samples each source had given before it.
    """

    def __init__(
        self,
        keys: list[str],
        sizes: list[int],
        weights: list[float],
        global_batch_size: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        if any(n < 1 for n in sizes):
            raise DataError(f"a blended source holds no sample: {dict(zip(keys, sizes))}")
        total = sum(weights)
        self.keys, self.sizes = keys, sizes
        self.weights = [w / total for w in weights]
        self.offsets = np.cumsum([0] + sizes).tolist()
        self.global_batch_size, self.seed, self.shuffle = global_batch_size, seed, shuffle
        self.origin, self.base = 0, [0] * len(keys)
        self._counts: dict[int, list[int]] = {0: [0] * len(keys)}  # since origin, by boundary
        self._steps: dict[int, list[int]] = {}  # boundary -> the step's dataset indices
        self._perms: dict[int, tuple[int, FeistelPermutation]] = {}  # source -> its epoch's

    def _boundary(self, position: int) -> int:
        """The start of the global batch holding stream `position`."""
        if position < self.origin:
            raise DataError(
                f"stream position {position} is before this blend began ({self.origin})"
            )
        return position - (position - self.origin) % self.global_batch_size

    def counts_at(self, boundary: int) -> list[int]:
        """Samples each source gave between the origin and step boundary `boundary`."""
        if boundary not in self._counts:
            known = max(b for b in self._counts if b <= boundary)
            counts = list(self._counts[known])
            for b in range(known, boundary, self.global_batch_size):
                interleave(self.weights, counts, b - self.origin, self.global_batch_size)
                self._counts[b + self.global_batch_size] = list(counts)
            for old in sorted(self._counts)[:-_KEPT_BOUNDARIES]:
                del self._counts[old]
        return list(self._counts[boundary])

    def cursors_at(self, boundary: int) -> list[int]:
        """Samples each source has given in all, before step boundary `boundary`."""
        return [b + c for b, c in zip(self.base, self.counts_at(boundary), strict=True)]

    def _sample(self, source: int, cursor: int) -> int:
        epoch, offset = divmod(cursor, self.sizes[source])
        if self.shuffle:
            known = self._perms.get(source)
            if known is None or known[0] != epoch:  # this source's current epoch's keys
                name = f"{self.seed}:{self.keys[source]}:{epoch}".encode()
                known = self._perms[source] = (epoch, FeistelPermutation(self.sizes[source], name))
            offset = known[1][offset]
        return self.offsets[source] + offset

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of stream positions [start, start + count), one global batch."""
        boundary = self._boundary(start)
        if boundary not in self._steps:
            counts = self.counts_at(boundary)
            cursors = [b + c for b, c in zip(self.base, counts, strict=True)]
            step = []
            for source in interleave(
                self.weights, counts, boundary - self.origin, self.global_batch_size
            ):
                step.append(self._sample(source, cursors[source]))
                cursors[source] += 1
            self._steps = {boundary: step} | {
                b: v for b, v in self._steps.items() if b > boundary - 4 * self.global_batch_size
            }
        offset = start - boundary
        return self._steps[boundary][offset : offset + count]

    def state_at(self, boundary: int) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "base": dict(zip(self.keys, self.base, strict=True)),
            "counts": dict(zip(self.keys, self.counts_at(boundary), strict=True)),
            "weights": dict(zip(self.keys, self.weights, strict=True)),
            "sizes": dict(zip(self.keys, self.sizes, strict=True)),
        }

    def load(self, state: dict[str, Any], boundary: int, same_blend: bool) -> None:
        """Continue a saved blend at step boundary `boundary`; or, when the blend changed
        on purpose (`checkpoint.allow_data_change`), start this one there, each source that
        is still in it continuing from the samples it had given."""
        cursors = {k: state["base"][k] + state["counts"][k] for k in state["base"]}
        if same_blend:
            # The data identity check stops a changed blend before this, but a checkpoint
            # that records no identity reaches here: continuing its counts under other
            # weights would silently break the invariant (and another name, the lookups).
            changes = weight_changes(state["weights"], dict(zip(self.keys, self.weights)))
            if changes:
                raise DataError(
                    f"the blend changed since the checkpoint ({'; '.join(changes)}): resume "
                    "with the checkpoint's [[data.mix]] weights, or pass "
                    "--checkpoint.allow_data_change=true to continue on this blend on purpose"
                )
            self.origin = int(state["origin"])
            self.base = [int(state["base"][k]) for k in self.keys]
            self._counts = {boundary: [int(state["counts"][k]) for k in self.keys]}
        else:
            self.origin = boundary
            self.base = [int(cursors.get(k, 0)) for k in self.keys]
            self._counts = {boundary: [0] * len(self.keys)}
        self._steps = {}


class MixtureDataset(Dataset):
    """Several datasets as one: index `offsets[i] + j` is sample j of dataset i."""

    def __init__(self, datasets: list[Dataset], names: list[str], summary: Any = None) -> None:
        self.datasets, self.names, self.summary = datasets, names, summary
        self.offsets = np.cumsum([0] + [len(d) for d in datasets]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> Batch:
        i = bisect_right(self.offsets, index) - 1
        return self.datasets[i][index - self.offsets[i]]
