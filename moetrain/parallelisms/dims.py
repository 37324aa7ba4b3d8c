"""Parallel degrees and their checks: arithmetic on the config, the world size and the ranks
per node (torchrun's LOCAL_WORLD_SIZE unless the config sets them) only.

Degrees (docs/parallelisms.md, "Device mesh"): world = pp * dp_replicate * dp_shard * cp;
expert parallelism borrows its ranks from dp_shard * cp; each of the pp pipeline stages
holds the other degrees' ranks. Every check here is arithmetic, so a
bad layout is refused before any process group exists, and without importing torch (a
refused launch answers at once). This file is the one owner of layout arithmetic, the split
of the global batch into per-rank micro-batches included: config, data and trainer call it
rather than checking again. The device meshes built from the degrees: `moetrain.parallelisms.mesh`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# parallel.cp_layout=balanced cuts a sequence into this many chunks per cp rank
# (moetrain.parallelisms.cp_schedule.balanced_table): enough pieces for a greedy fill to even out
CP_CHUNKS_PER_RANK = 8


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message names the keys and the fix."""


def world_size_from_env() -> int:
    """The world size torchrun will give us (1 for a plain `python train.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step: G / (micro * dp)."""
    for key, value in (
        ("train.global_batch_size", global_batch_size),
        ("train.micro_batch_size", micro_batch_size),
        ("the data-parallel size", dp_size),
    ):
        if value < 1:
            raise LayoutError(f"{key} must be >= 1, got {value}")
    if global_batch_size % micro_batch_size:
        raise LayoutError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({micro_batch_size})"
        )
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        fit = max(per_step, global_batch_size // per_step * per_step)
        raise LayoutError(
            f"train.global_batch_size={global_batch_size} must be divisible by "
            f"train.micro_batch_size ({micro_batch_size}) x data-parallel ranks ({dp_size}) = "
            f"{per_step}, so each rank runs a whole number of micro-batches per step; e.g. use "
            f"train.global_batch_size={fit}, or change train.micro_batch_size or the degrees"
        )
    return global_batch_size // per_step


def ranks_per_node_from_env(world_size: int) -> int:
    """The ranks torchrun starts on each node (its LOCAL_WORLD_SIZE; all of them without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def ep_fits_nodes(ep: int, ranks_per_node: int) -> bool:
    """Whether each ep group sits inside one node or spans whole nodes: what the dispatchers
    support. NOTE: ep groups are runs of consecutive ranks, so divisibility says it."""
    return ranks_per_node % ep == 0 or ep % ranks_per_node == 0


def check_ep_nodes(ep: int, ranks_per_node: int, where: str) -> None:
    """Refuse an ep that straddles nodes; `where`: what set the ranks per node."""
    if not ep_fits_nodes(ep, ranks_per_node):
        raise LayoutError(
            f"parallel.ep={ep} with {ranks_per_node} ranks per node ({where}): an "
            "expert-parallel group must fit inside one node (ep divides the ranks per "
            "node) or span whole nodes (ep a multiple of them); change parallel.ep"
        )


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int
    ranks_per_node: int = 0  # 0: every rank on one node
    pp: int = 1  # pipeline stages' ranks: the outermost degree

    @classmethod
    def resolve(
        cls,
        dp_replicate: int,
        dp_shard: int,
        cp: int,
        ep: int,
        world_size: int,
        ranks_per_node: int = 0,
        pp: int = 1,
    ) -> ParallelDims:
        """`ranks_per_node`: parallel.ranks_per_node (0: torchrun's LOCAL_WORLD_SIZE)."""
        # The degrees a message names: pp only where it is set.
        named = {"pp": pp} if pp > 1 else {}
        named |= {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp}

        def product(keys) -> str:
            return "parallel." + " * ".join(keys) + " = " + " * ".join(str(named[k]) for k in keys)

        fixed = pp * dp_replicate * cp
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by "
                    f"{product([k for k in named if k != 'dp_shard'])}; launch a multiple of "
                    f"{fixed} ranks or change the degrees"
                )
            dp_shard = named["dp_shard"] = world_size // fixed
        if fixed * dp_shard != world_size:
            raise LayoutError(
                f"{product(list(named))} = {fixed * dp_shard}, but the world size is "
                f"{world_size}; set parallel.dp_shard=-1 to use the rest, or launch that many "
                "ranks (torchrun --nproc_per_node=N)"
            )
        if (dp_shard * cp) % ep:
            raise LayoutError(
                f"parallel.ep={ep} must divide parallel.dp_shard * cp = {dp_shard * cp} "
                "(expert parallelism borrows its ranks from them)"
            )
        nodes_set = ranks_per_node > 0
        ranks_per_node = ranks_per_node if nodes_set else ranks_per_node_from_env(world_size)
        where = "parallel.ranks_per_node" if nodes_set else "torchrun's LOCAL_WORLD_SIZE"
        if world_size % ranks_per_node:
            raise LayoutError(
                f"{where} = {ranks_per_node} does not divide the world size {world_size}; "
                "every node must hold the same number of ranks"
            )
        check_ep_nodes(ep, ranks_per_node, where)
        return cls(dp_replicate, dp_shard, cp, ep, world_size, ranks_per_node, pp)

    @classmethod
    def of(cls, parallel, world_size: int) -> ParallelDims:
        """From a config's [parallel] section (moetrain.config.parallel_section.ParallelSection)."""
        p = parallel
        return cls.resolve(
            p.dp_replicate, p.dp_shard, p.cp, p.ep, world_size, p.ranks_per_node, p.pp
        )

    def grad_accum(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per rank per step; refuses a global batch this layout cannot split."""
        return grad_accum_steps(global_batch_size, micro_batch_size, self.dp_size)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_ranks(self) -> int:
        """Ranks that run one pipeline stage: together they hold the whole global batch."""
        return self.world_size // self.pp

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard one copy of the dense parameters."""
        return self.dp_shard * self.cp

    @property
    def ep_nodes(self) -> int:
        """Nodes one expert-parallel group spans (> 1: the two-stage dispatch)."""
        return max(1, self.ep // self.ranks_per_node) if self.ranks_per_node else 1

    def fsdp_gather(self, configured: str) -> str:
        """`parallel.fsdp_gather` as this layout runs it: `auto` is `step` where FSDP shards
        over one rank (no data or context parallel ranks, no pipeline stages), `micro_batch`
        elsewhere. NOTE: on one rank nothing is sharded: a gather is only the cast of the
        fp32 parameters to the compute dtype, and a reduction a copy. Per micro-batch they
        would be cast twice (forward, and again in backward after resharding) and copied
        once each; once per step, they are cast and copied once, for the price of holding
        the cast copy (2 bytes a parameter in bf16) through the step."""
        if configured != "auto":
            return configured
        one_rank = self.dp_size * self.cp == 1 and self.pp == 1
        return "step" if one_rank else "micro_batch"

    @property
    def efsdp_size(self) -> int:
        """Ranks that shard one expert-parallel slice of the routed experts."""
        return self.fsdp_size // self.ep


# parallel.pp_schedule: the schedules of torch.distributed.pipelining this trainer runs.
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# Two stages per rank placed in a V (rank r holds stages r and 2 pp - 1 - r), so that the
# first and the last stage share a rank: the zero-bubble schedules.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Pipeline stages each pp rank holds under `schedule` (parallel.pp_virtual_stages is
    Interleaved1F1B's choice; the V schedules hold two)."""
    if schedule in V_SCHEDULES:
        return 2
    return virtual_stages if schedule == "Interleaved1F1B" else 1


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that holds `stage`: round robin (looped), or in a V."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _least_micro_batches(schedule: str, pp: int) -> int:
    """DualPipeV runs at least one micro-batch per stage (2 pp); the others one per rank."""
    return 2 * pp if schedule == "DualPipeV" else pp


def pipeline_micro_batches_needed(schedule: str, pp: int, micro_batches: int) -> str | None:
    """What `schedule` needs of the step's micro-batches per rank that `micro_batches`
    lacks (None: it runs): their number is the pipeline's, a step's gradient accumulation."""
    least = _least_micro_batches(schedule, pp)
    if micro_batches < least:
        return f"at least {least} micro-batches per step"
    rounds = micro_batches // pp
    if schedule == "Interleaved1F1B" and micro_batches % rounds:
        # NOTE: torch runs it in n // pp rounds, whose number must divide n; that number moves
        # with n, so the fix is not "divisible by the rounds" but any multiple of pp.
        lower = pp * rounds
        return (
            f"a number of micro-batches divisible by its rounds, n // pp ({rounds} rounds for "
            f"{micro_batches}, which they do not divide): e.g. {lower} or {lower + pp}, as any "
            f"multiple of {pp}"
        )
    return None


def check_pipeline(
    pp: int,
    schedule: str,
    virtual_stages: int,
    micro_batches: int,
    global_batch_size: int,
    micro_batch_size: int = 1,
) -> None:
    """Refuse a pipeline schedule the step's micro-batches cannot feed, naming the global
    batch sizes nearest the configured one whose micro-batches it runs."""
    if pp == 1:
        return
    need = pipeline_micro_batches_needed(schedule, pp, micro_batches)
    if need is not None:
        per_micro = global_batch_size // micro_batches  # micro_batch_size x dp ranks
        nearest = _nearest_runnable(schedule, pp, micro_batches)
        sizes = " or ".join(f"{n * per_micro} ({n} micro-batches)" for n in nearest)
        smaller = ", or a smaller train.micro_batch_size" if micro_batch_size > 1 else ""
        raise LayoutError(
            f"parallel.pp_schedule={schedule} with parallel.pp={pp} needs {need}, but each rank "
            f"runs {micro_batches} (train.global_batch_size / (train.micro_batch_size x "
            f"data-parallel ranks)); e.g. use train.global_batch_size={sizes}{smaller}"
        )


def _nearest_runnable(schedule: str, pp: int, micro_batches: int) -> list[int]:
    """The multiples of pp nearest `micro_batches` that `schedule` runs (every schedule runs
    any multiple of pp from its least on): the largest below it, if any, and the smallest
    above."""
    least = _least_micro_batches(schedule, pp)
    below = micro_batches // pp * pp
    above = max(least, below + pp)
    return ([below] if least <= below < micro_batches else []) + [above]
