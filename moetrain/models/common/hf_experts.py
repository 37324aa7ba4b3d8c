"""Stacked routed experts <-> a checkpoint's per-expert keys, by a naming stated as data.

Native: `<prefix>.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
`<prefix>.down_proj [E, H, I]`. Checkpoints: `<prefix>.{e}.<gate>.weight`, `<prefix>.{e}.<up>
.weight` and `<prefix>.{e}.<down>.weight`, where `ExpertNaming` says what `prefix` ends with
and what the three projections are called: Qwen's and DeepSeek's `mlp.experts` with
`gate_proj`/`up_proj`/`down_proj` (the default), Mixtral's `block_sparse_moe.experts` with
`w1`/`w3`/`w2`. A model's adapter declares its naming; no model renames expert keys itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True)
class ExpertNaming:
    """How a checkpoint names one MoE layer's routed experts (checkpoint names, after any
    module renaming of the adapter)."""

    prefix: str = "mlp.experts"  # what the experts' module path ends with
    gate: str = "gate_proj"  # expert e's gate projection: <prefix>.{e}.<gate>.weight
    up: str = "up_proj"
    down: str = "down_proj"

    def is_stacked(self, hf_name: str) -> bool:
        """Whether checkpoint name `hf_name` is a stacked expert tensor of this naming."""
        module, _, param = hf_name.rpartition(".")
        return module.endswith("." + self.prefix) and param in ("gate_up_proj", "down_proj")

    def keys(self, module: str, num_experts: int, proj: str) -> list[str]:
        """Expert e's checkpoint key of projection `proj` ("gate", "up" or "down")."""
        name = getattr(self, proj)
        return [f"{module}.{e}.{name}.weight" for e in range(num_experts)]

    def per_expert_keys(self, hf_name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The per-expert keys that make the stacked tensor `hf_name` of `shape`, with theirs."""
        module, _, param = hf_name.rpartition(".")
        if param == "down_proj":
            return dict.fromkeys(self.keys(module, shape[0], "down"), tuple(shape[1:]))
        per_expert = (shape[1] // 2, shape[2])  # gate_up rows are gate's, then up's
        keys = self.keys(module, shape[0], "gate") + self.keys(module, shape[0], "up")
        return dict.fromkeys(keys, per_expert)

    def read_stacked(
        self,
        hf_name: str,
        num_experts: int,
        intermediate: int,
        get: Reader,
        index: tuple[slice, ...],
    ) -> torch.Tensor:
        """The part `index` of stacked `hf_name`, read from per-expert keys (only that part)."""
        module, _, param = hf_name.rpartition(".")
        experts, rows, cols = index
        local = range(*experts.indices(num_experts))
        if not local:  # an FSDP shard of the expert dim can be empty (fewer experts than ranks)
            return torch.empty(0, rows.stop - rows.start, cols.stop - cols.start)
        if param == "down_proj":
            keys = self.keys(module, num_experts, "down")
            return torch.stack([get(keys[e], (rows, cols)) for e in local])
        # gate_up rows [0, I) are the gate's, [I, 2I) the up projection's: read what `rows`
        # covers of each.
        start, stop, _ = rows.indices(2 * intermediate)
        gate_rows = slice(min(start, intermediate), min(stop, intermediate))
        up_rows = slice(
            max(start, intermediate) - intermediate, max(stop, intermediate) - intermediate
        )
        gate_keys = self.keys(module, num_experts, "gate")
        up_keys = self.keys(module, num_experts, "up")
        return torch.stack(
            [
                torch.cat([get(gate_keys[e], (gate_rows, cols)), get(up_keys[e], (up_rows, cols))])
                for e in local
            ]
        )

    def split_stacked(self, hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint entries of the full stacked value of `hf_name`."""
        module, _, param = hf_name.rpartition(".")
        num_experts = tensor.shape[0]
        if param == "down_proj":
            return dict(zip(self.keys(module, num_experts, "down"), tensor.unbind(0)))
        gate, up = tensor.chunk(2, dim=1)
        out = dict(zip(self.keys(module, num_experts, "gate"), gate.unbind(0)))
        out.update(zip(self.keys(module, num_experts, "up"), up.unbind(0)))
        return out


# Qwen-MoE's, OLMoE's and DeepSeek's naming.
MLP_EXPERTS = ExpertNaming()
