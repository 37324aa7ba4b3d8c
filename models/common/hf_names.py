"""The weight half of an HF adapter for models whose native names are the checkpoint's
without the leading "model." (the head excepted), up to a table of module renames, and
whose routed experts are stacked (`models.common.hf_experts`): Qwen3-MoE, OLMoE, Mixtral,
Qwen2-MoE and GLM-4.5 share it.

A model's `hf.py` binds one `PrefixedStackedNames` and exports its four methods as the
adapter's `is_redundant_key`, `hf_keys`, `from_hf` and `to_hf` (`models.spec.HFAdapter`).
Everything model-specific is data: the expert count and width, whether the head is tied,
the experts' naming and the renames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models import HFFormatError
from models.common.hf_experts import MLP_EXPERTS, ExpertNaming
from models.spec import GetSlice, HasKey


class PrefixedStackedNames:
    def __init__(
        self,
        expert_width: Callable[[Any], tuple[int, int]],
        tied: Callable[[Any], bool],
        experts: ExpertNaming = MLP_EXPERTS,
        renames: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """expert_width(args) -> (num_experts, each expert's hidden width); tied(args) -> bool.
        `experts`: how the checkpoint names the routed experts. `renames`: (native, checkpoint)
        pairs of dotted module paths that differ, applied in order to whole name components,
        e.g. Mixtral's ("mlp", "block_sparse_moe")."""
        self.expert_width = expert_width
        self.tied = tied
        self.experts = experts
        self.renames = renames

    def hf_name(self, name: str) -> str:
        """The checkpoint name of native `name` (a stacked expert keeps its stacked name)."""
        if name.startswith("lm_head."):
            return name
        dotted = f".{name}."
        for native, checkpoint in self.renames:
            dotted = dotted.replace(f".{native}.", f".{checkpoint}.")
        return "model." + dotted[1:-1]

    def whole_key(self, name: str, has: HasKey) -> str | None:
        """The checkpoint key that holds native `name` whole, if any: its checkpoint name,
        or transformers-5's in-memory name ("model." + the native name: it renamed the
        modules as we do, e.g. Mixtral's `block_sparse_moe` to `mlp`, and stacks experts)."""
        hf = self.hf_name(name)
        if has(hf):
            return hf
        if self.renames and not name.startswith("lm_head.") and has("model." + name):
            return "model." + name
        return None

    def is_redundant_key(self, key: str, args: Any, has: HasKey) -> bool:
        """A tied model's head, which some exporters write anyway."""
        return key == "lm_head.weight" and self.tied(args)

    def hf_keys(
        self, name: str, shape: tuple[int, ...], args: Any, has: HasKey
    ) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys that make native `name` of global `shape`, with theirs.
        Stacked experts in the checkpoint (transformers-5 in-memory names) are read too."""
        hf = self.hf_name(name)
        whole = self.whole_key(name, has)
        if whole is not None or not self.experts.is_stacked(hf):
            return {whole or hf: tuple(shape)}
        return self.experts.per_expert_keys(hf, shape)

    def from_hf(
        self, name: str, args: Any, has: HasKey, get: GetSlice, index: tuple[slice, ...]
    ) -> torch.Tensor:
        """The part `index` of native `name`, reading only that part of the checkpoint (a
        rank's experts under EP, its rows under FSDP)."""
        hf, whole = self.hf_name(name), self.whole_key(name, has)
        if whole is not None:
            return get(whole, index)
        if self.experts.is_stacked(hf):
            num_experts, width = self.expert_width(args)
            return self.experts.read_stacked(hf, num_experts, width, get, index)
        raise HFFormatError(f"checkpoint has no tensor {hf!r} (needed for {name!r})")

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
        """HF entries (per-expert keys) for the full value of native `name`."""
        hf = self.hf_name(name)
        if self.experts.is_stacked(hf):
            return self.experts.split_stacked(hf, tensor)
        return {hf: tensor}
