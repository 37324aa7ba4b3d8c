"""The weight half of an HF adapter for models whose native names are the checkpoint's
without the leading "model." (the head excepted), up to a table of module renames, and
whose routed experts are stacked (`moetrain.models.common.hf_experts`): Qwen3-MoE, OLMoE, Mixtral,
Qwen2-MoE, GLM-4.5 and ERNIE-4.5 share it.

A model's `hf.py` binds one `PrefixedStackedNames` and exports its four methods as the
adapter's `is_redundant_key`, `hf_keys`, `from_hf` and `to_hf` (`moetrain.models.spec.HFAdapter`).
Everything model-specific is data: the expert count and width, whether the head is tied,
the experts' naming, the renames, the tensors that move to another module (and shape) in
the checkpoint, the state no checkpoint holds and the checkpoint keys no model reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetrain.models import HFFormatError
from moetrain.models.common.hf_experts import MLP_EXPERTS, ExpertNaming
from moetrain.models.spec import GetSlice, HasKey


@dataclass(frozen=True)
class Moved:
    """A tensor that the checkpoint keeps under another module, with `leading_ones` extra
    leading dims of size 1. ERNIE-4.5's routing bias: native `mlp.gate.e_score_correction_bias`
    [E] is `mlp.moe_statics.e_score_correction_bias` [1, E] on disk, and transformers-5 holds
    it as `mlp.gate.moe_statics.e_score_correction_bias` [1, E] in memory (an alias):

        Moved("mlp.gate.e_score_correction_bias", "mlp.moe_statics.e_score_correction_bias",
              leading_ones=1, aliases=("mlp.gate.moe_statics.e_score_correction_bias",))

    Import reads the first of (checkpoint, *aliases) the file holds; export writes
    `checkpoint`. Paths are whole trailing components of the native name; `renames` apply
    to the rest of it afterwards."""

    native: str
    checkpoint: str
    leading_ones: int = 0
    aliases: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        return name == self.native or name.endswith("." + self.native)

    def spellings(self, name: str) -> list[str]:
        """Native `name`'s names in a checkpoint, without the prefix: the written one first."""
        stem = name[: len(name) - len(self.native)]
        return [stem + path for path in (self.checkpoint, *self.aliases)]


class PrefixedStackedNames:
    def __init__(
        self,
        expert_width: Callable[[Any], tuple[int, int]],
        tied: Callable[[Any], bool],
        experts: ExpertNaming = MLP_EXPERTS,
        renames: tuple[tuple[str, str], ...] = (),
        moved: tuple[Moved, ...] = (),
        no_checkpoint: tuple[str, ...] = (),
        ignored: tuple[str, ...] = (),
    ) -> None:
        """expert_width(args) -> (num_experts, each expert's hidden width); tied(args) -> bool.
        `experts`: how the checkpoint names the routed experts. `renames`: (native, checkpoint)
        pairs of dotted module paths that differ, applied in order to whole name components,
        e.g. Mixtral's ("mlp", "block_sparse_moe"). `moved`: tensors kept under another
        module and shape (`Moved`). `no_checkpoint`: trailing components of native names no
        checkpoint holds (a router's `tokens_per_expert` counts): nothing is written for
        them, and they start at zero on import. `ignored`: patterns (`re.search`) of
        checkpoint keys no native tensor reads that a valid checkpoint may hold, as
        transformers' `_keys_to_ignore_on_load_unexpected` (e.g. ERNIE-4.5's "mtp")."""
        self.expert_width = expert_width
        self.tied = tied
        self.experts = experts
        self.renames = renames
        self.moved = moved
        self.no_checkpoint = no_checkpoint
        self.ignored = tuple(re.compile(p) for p in ignored)

    def _prefixed(self, name: str) -> str:
        if name.startswith("lm_head."):
            return name
        dotted = f".{name}."
        for native, checkpoint in self.renames:
            dotted = dotted.replace(f".{native}.", f".{checkpoint}.")
        return "model." + dotted[1:-1]

    def _move(self, name: str) -> Moved | None:
        return next((m for m in self.moved if m.matches(name)), None)

    def _unstored(self, name: str) -> bool:
        return any(name == s or name.endswith("." + s) for s in self.no_checkpoint)

    def hf_name(self, name: str) -> str:
        """The checkpoint name of native `name` (a stacked expert keeps its stacked name)."""
        move = self._move(name)
        return self._prefixed(move.spellings(name)[0] if move else name)

    def whole_key(self, name: str, has: HasKey) -> str | None:
        """The checkpoint key that holds native `name` whole, if any: its checkpoint name
        (or a moved tensor's alias), or transformers-5's in-memory name ("model." + the
        native name: it renamed the modules as we do, e.g. Mixtral's `block_sparse_moe` to
        `mlp`, and stacks experts)."""
        move = self._move(name)
        for spelling in move.spellings(name) if move else [name]:
            if has(self._prefixed(spelling)):
                return self._prefixed(spelling)
        if self.renames and not name.startswith("lm_head.") and has("model." + name):
            return "model." + name
        return None

    def is_redundant_key(self, key: str, args: Any, has: HasKey) -> bool:
        """A tied model's head, which some exporters write anyway, and `ignored` keys."""
        if key == "lm_head.weight" and self.tied(args):
            return True
        return any(p.search(key) for p in self.ignored)

    def hf_keys(
        self, name: str, shape: tuple[int, ...], args: Any, has: HasKey
    ) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys that make native `name` of global `shape`, with theirs.
        Stacked experts in the checkpoint (transformers-5 in-memory names) are read too."""
        if self._unstored(name):
            return {}
        move = self._move(name)
        if move is not None:
            key = self.whole_key(name, has) or self.hf_name(name)
            return {key: (1,) * move.leading_ones + tuple(shape)}
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
        if self._unstored(name):  # e.g. no assignments counted yet
            return torch.zeros([s.stop - s.start for s in index])
        hf, whole = self.hf_name(name), self.whole_key(name, has)
        move = self._move(name)
        if whole is not None and move is not None:
            ones = move.leading_ones
            part = get(whole, (slice(0, 1),) * ones + tuple(index))
            return part.reshape(part.shape[ones:])
        if whole is not None:
            return get(whole, index)
        if self.experts.is_stacked(hf):
            num_experts, width = self.expert_width(args)
            return self.experts.read_stacked(hf, num_experts, width, get, index)
        raise HFFormatError(f"checkpoint has no tensor {hf!r} (needed for {name!r})")

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
        """HF entries (per-expert keys) for the full value of native `name`."""
        if self._unstored(name):
            return {}
        hf = self.hf_name(name)
        move = self._move(name)
        if move is not None:
            return {hf: tensor.reshape((1,) * move.leading_ones + tuple(tensor.shape))}
        if self.experts.is_stacked(hf):
            return self.experts.split_stacked(hf, tensor)
        return {hf: tensor}
