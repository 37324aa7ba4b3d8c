"""A seeded permutation of [0, n) that needs no table: O(1) memory for any corpus size.

A shuffled epoch over billions of samples cannot hold `randperm(n)` (8 bytes a sample on
every rank). Instead position i of the epoch maps to sample `permute(i)`: a 4-round
Feistel network over the smallest even number of bits that covers n is a bijection on
[0, 2^bits); "cycle walking" (apply it again while the result is >= n) restricts it to a
bijection on [0, n). Since 2^bits < 4n, a walk takes fewer than 4 applications on
average. Each round mixes one half with a keyed 64-bit hash of the other half.
"""

from __future__ import annotations

import hashlib

import numpy as np

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _mix(x: int) -> int:
    """A 64-bit finaliser (splitmix64's): every input bit moves every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class FeistelPermutation:
    """`permutation[i]` for i in [0, n): a bijection of [0, n) chosen by `key`."""

    def __init__(self, n: int, key: bytes) -> None:
        if n < 1:
            raise ValueError(f"need n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2  # both halves this wide: the domain is 4^half >= n
        self.mask = (1 << self.half) - 1
        digest = hashlib.blake2b(key, digest_size=8 * _ROUNDS).digest()
        self.keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS)]

    def _once(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"position {i} out of range [0, {self.n})")
        x = self._once(i)
        while x >= self.n:  # cycle walking: stays a bijection on [0, n)
            x = self._once(x)
        return x

    def __len__(self) -> int:
        return self.n

    def all(self) -> np.ndarray:
        """The whole permutation (for tests and small n): int64 [n]."""
        return np.array([self[i] for i in range(self.n)], dtype=np.int64)
