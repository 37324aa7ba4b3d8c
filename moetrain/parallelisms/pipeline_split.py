"""Where pipeline stages are cut: the plan's blocks split by FLOPs (or by hand), and a meta
model pruned to one stage's modules.

The model describes itself as data (`moetrain.models.common.plan.ParallelPlan`): `embedding`
modules run before the blocks, on the first stage; `head` modules after them, on the last
(final norm, output head, and the MTP blocks, which sit inside a head module). The other
blocks, the trunk, are cut into `stages` contiguous runs in plan order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moetrain.models.common.flops import active_params
from moetrain.models.common.plan import ParallelPlan
from moetrain.parallelisms.dims import LayoutError
from moetrain.parallelisms.plan import match_modules


def _inside(fqn: str, parents: list[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in parents)


def trunk_blocks(model: nn.Module, plan: ParallelPlan) -> list[tuple[str, nn.Module]]:
    """The blocks cut into stages, in order: every plan block outside the head modules."""
    head = [fqn for fqn, _ in match_modules(model, plan.head, "head", required=False)]
    return [(f, m) for f, m in match_modules(model, plan.blocks, "blocks") if not _inside(f, head)]


def module_flops(module: nn.Module, attention_per_core: float, cores: set[int]) -> float:
    """Training FLOPs per token of `module`: 6 x the parameters a token multiplies with
    (routed experts by their top-k share), plus an equal share of the model's attention
    FLOPs for each attention core inside it."""
    n_cores = sum(1 for m in module.modules() if id(m) in cores)
    return 6 * active_params(module, None) + attention_per_core * n_cores


@dataclass(frozen=True)
class StageCosts:
    """Per-token FLOPs of the pieces a stage is made of."""

    blocks: list[float]  # each trunk block, in order
    first: float  # what the first stage runs besides its blocks (the embedding: a lookup)
    last: float  # what the last stage runs besides its blocks (norm, head, MTP)


def stage_costs(
    model: nn.Module, plan: ParallelPlan, attention_flops: float, total_flops: float | None = None
) -> StageCosts:
    """`attention_flops`: the model's attention FLOPs per token (the spec's
    `flops_per_token(...).by_kind["attention"]`), shared equally by its attention cores.
    `total_flops`: the spec's whole count; the last stage then runs what of it the trunk
    blocks do not (its head modules, and what only the count knows: DeepSeek-V3's MTP
    depths passing through the shared output head again), else its head modules' FLOPs."""
    cores = (
        {id(m) for _, m in match_modules(model, plan.attention_core, "attention_core")}
        if plan.attention_core is not None
        else set()
    )
    per_core = attention_flops / max(len(cores), 1)
    heads = match_modules(model, plan.head, "head", required=False)
    blocks = [module_flops(m, per_core, cores) for _, m in trunk_blocks(model, plan)]
    last = sum(module_flops(m, per_core, cores) for _, m in heads)
    if total_flops is not None:
        last = max(last, total_flops - sum(blocks))
    return StageCosts(blocks=blocks, first=0.0, last=last)  # NOTE: an embedding is a gather


def balanced_split(costs: StageCosts, stages: int) -> list[int]:
    """Blocks per stage (each >= 1), contiguous, minimising the costliest stage.

    Dynamic programming over (stages used, blocks placed): exact for the max, and among
    equal maxima the earliest cut wins, so the split is deterministic.
    """
    n = len(costs.blocks)
    if n < stages:
        raise LayoutError(
            f"{stages} pipeline stages need at least {stages} blocks to split, the model has "
            f"{n}; lower parallel.pp (or the stages per rank of its schedule)"
        )
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.first if stage == 0 else 0.0) + (costs.last if stage == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: the least possible max over stages 0..s-1 holding blocks 0..i-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def rank_loads(costs: StageCosts, counts: list[int], rank_of: list[int]) -> list[float]:
    """Each pp rank's FLOPs per token: the sum of its stages' under the split `counts`."""
    loads = [0.0] * (max(rank_of) + 1)
    lo = 0
    for stage, n in enumerate(counts):
        extra = (costs.first if stage == 0 else 0.0) + (
            costs.last if stage == len(counts) - 1 else 0.0
        )
        loads[rank_of[stage]] += sum(costs.blocks[lo : lo + n]) + extra
        lo += n
    return loads


def rank_balanced_split(costs: StageCosts, rank_of: list[int]) -> list[int]:
    """Blocks per stage (each >= 1), contiguous, for schedules that put several stages on a
    rank (`rank_of`: stage -> pp rank): the costliest rank, not the costliest stage, is what
    the pipeline waits for. From `balanced_split`, one block moves across one boundary at a
    time while that lowers the rank loads (the highest first, then the next; a descent, so
    deterministic but not proven optimal). DeepSeek-V3 (MTP on) on a pp 16 V: the busiest
    rank from 1.63x the mean to 1.39x, the floor while each stage holds a block (rank 0
    holds the first stage and the last, with the head and MTP)."""
    counts = balanced_split(costs, len(rank_of))

    def key(c: list[int]) -> list[float]:
        return sorted(rank_loads(costs, c, rank_of), reverse=True)

    best = key(counts)
    while True:
        moves = []
        for b in range(len(counts) - 1):  # the boundary after stage b
            for step in (-1, 1):  # a block from stage b to b + 1, or back
                trial = list(counts)
                trial[b] += step
                trial[b + 1] -= step
                if min(trial[b], trial[b + 1]) >= 1:
                    moves.append((key(trial), trial))
        if not moves:
            return counts
        value, trial = min(moves)
        if value >= best:
            return counts
        best, counts = value, trial


def check_split(counts: list[int], blocks: int, stages: int) -> None:
    """Refuse a hand-set parallel.pp_layers that does not cover the blocks exactly."""
    if len(counts) != stages or sum(counts) != blocks or min(counts) < 1:
        raise LayoutError(
            f"parallel.pp_layers={counts} must give {stages} stages of at least one block each, "
            f"summing to the model's {blocks} blocks before its head; e.g. "
            f"{_even(blocks, stages)}, or [] to split by FLOPs"
        )


def _even(blocks: int, stages: int) -> list[int]:
    return [blocks // stages + (s < blocks % stages) for s in range(stages)]


def stage_block_names(model: nn.Module, plan: ParallelPlan, counts: list[int]) -> list[list[str]]:
    """The FQNs of each stage's trunk blocks."""
    names = [fqn for fqn, _ in trunk_blocks(model, plan)]
    out, start = [], 0
    for c in counts:
        out.append(names[start : start + c])
        start += c
    return out


def prune_to_stage(
    model: nn.Module,
    plan: ParallelPlan,
    keep: list[str],
    first: bool,
    last: bool,
    embedding_on_last: bool = False,
) -> None:
    """Remove from `model` (meta, in place) every module that is not this stage's: trunk
    blocks not in `keep`, the embedding unless `first` (or `last` with
    `embedding_on_last`: a head that reads the embedding gets its own copy), the head
    unless `last`.

    FQNs are kept: a block list becomes a `ModuleDict` of the kept blocks under their
    original indices, so checkpoint keys do not depend on the cut (`layers.5...` stays
    `layers.5...`). A removed embedding or head module becomes None.
    """
    drop: list[str] = [f for f, _ in trunk_blocks(model, plan) if f not in set(keep)]
    if not (first or (last and embedding_on_last)):
        drop += [f for f, _ in match_modules(model, plan.embedding, "embedding", required=False)]
    if not last:
        drop += [f for f, _ in match_modules(model, plan.head, "head", required=False)]
    by_parent: dict[str, list[str]] = {}
    for fqn in drop:
        parent, _, name = fqn.rpartition(".")
        by_parent.setdefault(parent, []).append(name)
    for parent_fqn, names in by_parent.items():
        parent = model.get_submodule(parent_fqn)
        if isinstance(parent, nn.ModuleList | nn.ModuleDict):
            kept = {k: m for k, m in parent.named_children() if k not in names}
            grand, _, attr = parent_fqn.rpartition(".")
            setattr(model.get_submodule(grand), attr, nn.ModuleDict(kept))
        else:
            for name in names:
                setattr(parent, name, None)
