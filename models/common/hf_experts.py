"""Stacked routed experts <-> Hugging Face's per-expert checkpoint keys.

Native: `<prefix>.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
`<prefix>.down_proj [E, H, I]`. HF checkpoints: `<prefix>.{e}.{gate,up,down}_proj.weight`.
Shared by the model adapters whose experts use this layout (Qwen3-MoE, DeepSeek-V3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]


def is_stacked_expert(hf_name: str) -> bool:
    prefix, _, param = hf_name.rpartition(".")
    return prefix.endswith(".mlp.experts") and param in ("gate_up_proj", "down_proj")


def _keys(prefix: str, num_experts: int, proj: str) -> list[str]:
    return [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]


def per_expert_keys(hf_name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-expert keys that make the stacked tensor `hf_name` of `shape`, with theirs."""
    prefix, _, param = hf_name.rpartition(".")
    if param == "down_proj":
        return dict.fromkeys(_keys(prefix, shape[0], "down_proj"), tuple(shape[1:]))
    per_expert = (shape[1] // 2, shape[2])  # gate_up rows are gate's, then up's
    keys = _keys(prefix, shape[0], "gate_proj") + _keys(prefix, shape[0], "up_proj")
    return dict.fromkeys(keys, per_expert)


def read_stacked(
    hf_name: str, num_experts: int, intermediate: int, get: Reader, index: tuple[slice, ...]
) -> torch.Tensor:
    """The part `index` of stacked `hf_name`, read from per-expert keys (only that part)."""
    prefix, _, param = hf_name.rpartition(".")
    experts, rows, cols = index
    local = range(*experts.indices(num_experts))
    if not local:  # an FSDP shard of the expert dim can be empty (fewer experts than ranks)
        return torch.empty(0, rows.stop - rows.start, cols.stop - cols.start)
    if param == "down_proj":
        keys = _keys(prefix, num_experts, "down_proj")
        return torch.stack([get(keys[e], (rows, cols)) for e in local])
    # gate_up rows [0, I) are gate_proj's, [I, 2I) up_proj's: read what `rows` covers.
    start, stop, _ = rows.indices(2 * intermediate)
    gate_rows = slice(min(start, intermediate), min(stop, intermediate))
    up_rows = slice(max(start, intermediate) - intermediate, max(stop, intermediate) - intermediate)
    gate_keys = _keys(prefix, num_experts, "gate_proj")
    up_keys = _keys(prefix, num_experts, "up_proj")
    return torch.stack(
        [
            torch.cat([get(gate_keys[e], (gate_rows, cols)), get(up_keys[e], (up_rows, cols))])
            for e in local
        ]
    )


def split_stacked(hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-expert HF entries of the full stacked value of `hf_name`."""
    prefix, _, param = hf_name.rpartition(".")
    num_experts = tensor.shape[0]
    if param == "down_proj":
        return dict(zip(_keys(prefix, num_experts, "down_proj"), tensor.unbind(0)))
    gate, up = tensor.chunk(2, dim=1)
    out = dict(zip(_keys(prefix, num_experts, "gate_proj"), gate.unbind(0)))
    out.update(zip(_keys(prefix, num_experts, "up_proj"), up.unbind(0)))
    return out
