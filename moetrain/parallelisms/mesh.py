"""The device meshes of a layout (`moetrain.parallelisms.dims.ParallelDims`): the batch view, the
dense parameters' FSDP mesh, under expert parallelism the experts' (efsdp, ep) mesh, and
under pipeline parallelism the pp mesh. Every mesh is over all ranks with pp outermost:
the other views are this rank's stage's slice."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.parallelisms.dims import ParallelDims


@dataclass
class Meshes:
    world: DeviceMesh  # dims (dp_replicate, dp_shard, cp): the batch view (this stage's ranks)
    dense: DeviceMesh  # FSDP of dense params: (fsdp,) or (dp_replicate, fsdp) for HSDP
    # Routed experts, when ep > 1: `ep` shards dim 0 (EP), `expert_fsdp` shards dim 1
    # ((efsdp,) or (dp_replicate, efsdp) for HSDP). Both are slices of one (dp_replicate,
    # efsdp, ep) mesh, as FSDP2 requires for a parameter that is already a DTensor.
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
    # When an ep group spans whole nodes: its split into (ep_rail: the same local index on
    # each node, ep_node: the ranks of one node), for the two-stage dispatch.
    ep_rail: DeviceMesh | None = None
    ep_node: DeviceMesh | None = None
    ranks_per_node: int = 0  # 0: every rank on one node
    # The ranks that hold the other stages of this rank's pipeline (pp > 1).
    pp: DeviceMesh | None = None
    # The batch view flattened, for reductions over the whole global batch (pp > 1; else
    # None: the world's default group).
    batch: DeviceMesh | None = None

    def batch_group(self) -> ProcessGroup | None:
        """The process group of every rank of this stage: the global batch's holders."""
        return self.batch.get_group() if self.batch is not None else None

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (dp_replicate-major)."""
        rep = self.world.get_local_rank("dp_replicate")
        return rep * self.world["dp_shard"].size() + self.world.get_local_rank("dp_shard")

    @property
    def cp(self) -> int:
        return self.world["cp"].size()


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    full = init_device_mesh(
        device_type,
        (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp"),
    )
    world = full["dp_replicate", "dp_shard", "cp"]
    # NOTE: DeviceMesh._flatten is private but is how one mesh dim spans two (torchtitan
    # does the same); it keeps every view a slice of the one world mesh.
    fsdp = world["dp_shard", "cp"]._flatten("fsdp")
    dense = full["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else fsdp
    meshes = Meshes(world=world, dense=dense, ranks_per_node=dims.ranks_per_node)
    if dims.pp > 1:
        meshes.pp = full["pp"]
        meshes.batch = world._flatten("batch")
    if dims.ep > 1:
        # NOTE: a second mesh over the same ranks in the same (row-major) order: ep groups
        # are runs of consecutive ranks inside one fsdp group, so EP traffic stays as local
        # (same node) as the fsdp group itself.
        sparse = init_device_mesh(
            device_type,
            (dims.pp, dims.dp_replicate, dims.efsdp_size, dims.ep),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"),
        )
        meshes.ep = sparse["ep"]
        meshes.expert_fsdp = (
            sparse["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else sparse["efsdp"]
        )
    if dims.ep_nodes > 1:
        # The ep dim split (nodes, ranks of a node): an ep group starts on a node boundary
        # (ParallelDims.resolve), so ep index = node * ranks_per_node + local index.
        split = init_device_mesh(
            device_type,
            (dims.pp, dims.dp_replicate, dims.efsdp_size, dims.ep_nodes, dims.ep // dims.ep_nodes),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep_rail", "ep_node"),
        )
        meshes.ep_rail, meshes.ep_node = split["ep_rail"], split["ep_node"]
    return meshes
