"""The weight half of an HF adapter for models whose native names are HF's without the
leading "model." (the head excepted) and whose routed experts are stacked
(`models.common.hf_experts`): Qwen3-MoE and OLMoE share it.

A model's `hf.py` binds one `PrefixedStackedNames` and exports its four methods as the
adapter's `is_redundant_key`, `hf_keys`, `from_hf` and `to_hf` (`models.spec.HFAdapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models import HFFormatError
from models.common.hf_experts import is_stacked_expert, per_expert_keys, read_stacked, split_stacked
from models.spec import GetSlice, HasKey


class PrefixedStackedNames:
    def __init__(
        self, expert_width: Callable[[Any], tuple[int, int]], tied: Callable[[Any], bool]
    ) -> None:
        # expert_width(args) -> (num_experts, each expert's hidden width); tied(args) -> bool
        self.expert_width = expert_width
        self.tied = tied

    @staticmethod
    def hf_name(name: str) -> str:
        return name if name.startswith("lm_head.") else "model." + name

    def is_redundant_key(self, key: str, args: Any, has: HasKey) -> bool:
        """A tied model's head, which some exporters write anyway."""
        return key == "lm_head.weight" and self.tied(args)

    def hf_keys(
        self, name: str, shape: tuple[int, ...], args: Any, has: HasKey
    ) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys that make native `name` of global `shape`, with theirs.
        Stacked experts in the checkpoint (transformers-5 in-memory names) are read too."""
        hf = self.hf_name(name)
        if has(hf) or not is_stacked_expert(hf):
            return {hf: tuple(shape)}
        return per_expert_keys(hf, shape)

    def from_hf(
        self, name: str, args: Any, has: HasKey, get: GetSlice, index: tuple[slice, ...]
    ) -> torch.Tensor:
        """The part `index` of native `name`, reading only that part of the checkpoint (a
        rank's experts under EP, its rows under FSDP)."""
        hf = self.hf_name(name)
        if has(hf):
            return get(hf, index)
        if is_stacked_expert(hf):
            num_experts, width = self.expert_width(args)
            return read_stacked(hf, num_experts, width, get, index)
        raise HFFormatError(f"checkpoint has no tensor {hf!r} (needed for {name!r})")

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
        """HF entries (per-expert keys) for the full value of native `name`."""
        hf = self.hf_name(name)
        return split_stacked(hf, tensor) if is_stacked_expert(hf) else {hf: tensor}
