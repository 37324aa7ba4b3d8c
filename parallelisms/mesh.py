"""Parallel degrees, their checks, and the device mesh built from them.

Degrees (DESIGN §3): world = dp_replicate * dp_shard * cp; expert parallelism borrows
its ranks from dp_shard * cp. Every check here is arithmetic on the config and the world
size, so a bad layout is refused before any process group exists. This file is the one
owner of layout arithmetic, the split of the global batch into per-rank micro-batches
included: config, data and trainer call it rather than checking again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    @classmethod
    def resolve(
        cls, dp_replicate: int, dp_shard: int, cp: int, ep: int, world_size: int
    ) -> ParallelDims:
        fixed = dp_replicate * cp
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate * "
                    f"parallel.cp = {dp_replicate} * {cp}; launch a multiple of {fixed} ranks "
                    "or change the degrees"
                )
            dp_shard = world_size // fixed
        if dp_replicate * dp_shard * cp != world_size:
            raise LayoutError(
                f"parallel.dp_replicate * dp_shard * cp = {dp_replicate} * {dp_shard} * {cp} = "
                f"{dp_replicate * dp_shard * cp}, but the world size is {world_size}; set "
                "parallel.dp_shard=-1 to use the rest, or launch that many ranks "
                "(torchrun --nproc_per_node=N)"
            )
        if (dp_shard * cp) % ep:
            raise LayoutError(
                f"parallel.ep={ep} must divide parallel.dp_shard * cp = {dp_shard * cp} "
                "(expert parallelism borrows its ranks from them)"
            )
        return cls(dp_replicate, dp_shard, cp, ep, world_size)

    def grad_accum(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per rank per step; refuses a global batch this layout cannot split."""
        return grad_accum_steps(global_batch_size, micro_batch_size, self.dp_size)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard one copy of the dense parameters."""
        return self.dp_shard * self.cp

    @property
    def efsdp_size(self) -> int:
        """Ranks that shard one expert-parallel slice of the routed experts."""
        return self.fsdp_size // self.ep


@dataclass
class Meshes:
    world: DeviceMesh  # dims (dp_replicate, dp_shard, cp): the batch view
    dense: DeviceMesh  # FSDP of dense params: (fsdp,) or (dp_replicate, fsdp) for HSDP
    # Routed experts, when ep > 1: `ep` shards dim 0 (EP), `expert_fsdp` shards dim 1
    # ((efsdp,) or (dp_replicate, efsdp) for HSDP). Both are slices of one (dp_replicate,
    # efsdp, ep) mesh, as FSDP2 requires for a parameter that is already a DTensor.
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (dp_replicate-major)."""
        rep = self.world.get_local_rank("dp_replicate")
        return rep * self.world["dp_shard"].size() + self.world.get_local_rank("dp_shard")

    @property
    def cp(self) -> int:
        return self.world["cp"].size()


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    world = init_device_mesh(
        device_type,
        (dims.dp_replicate, dims.dp_shard, dims.cp),
        mesh_dim_names=("dp_replicate", "dp_shard", "cp"),
    )
    # NOTE: DeviceMesh._flatten is private but is how one mesh dim spans two (torchtitan
    # does the same); it keeps every view a slice of the one world mesh.
    fsdp = world["dp_shard", "cp"]._flatten("fsdp")
    dense = world["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else fsdp
    meshes = Meshes(world=world, dense=dense)
    if dims.ep > 1:
        # NOTE: a second mesh over the same ranks in the same (row-major) order: ep groups
        # are runs of consecutive ranks inside one fsdp group, so EP traffic stays as local
        # (same node) as the fsdp group itself.
        sparse = init_device_mesh(
            device_type,
            (dims.dp_replicate, dims.efsdp_size, dims.ep),
            mesh_dim_names=("dp_replicate", "efsdp", "ep"),
        )
        meshes.ep = sparse["ep"]
        meshes.expert_fsdp = (
            sparse["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else sparse["efsdp"]
        )
    return meshes
