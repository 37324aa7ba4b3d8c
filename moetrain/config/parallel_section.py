"""The `[parallel]` section of the job configuration: the degrees and how each runs (split
out of `schema.py`, which holds the rest and `JobConfig`). The arithmetic that relates them
to the world size is `moetrain.parallelisms.dims`'s."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg
from moetrain.parallelisms.dims import PP_SCHEDULES


@dataclass
class ParallelSection:
    dp_replicate: int = arg(1, "replicas of the sharded model (HSDP when > 1)", ge=1)
    # -1 or >= 1: a hole in the range that bounds cannot say, so checks.py tests it.
    dp_shard: int = arg(-1, "FSDP shard degree; -1 = the rest of the world size")
    cp: int = arg(1, "context-parallel degree (sequence split across ranks)", ge=1)
    ep: int = arg(1, "expert-parallel degree (borrows ranks from dp_shard * cp)", ge=1)
    ranks_per_node: int = arg(
        0,
        "ranks on one node (0 = torchrun's LOCAL_WORLD_SIZE); an ep group over several "
        "nodes dispatches in two stages (each token crosses to a node once, then fans out "
        "inside it); set it below the ranks of one machine to simulate nodes",
        ge=0,
        note="0 = LOCAL_WORLD_SIZE",
    )
    ep_overlap: str = arg(
        "shared",
        "what runs while a MoE layer's expert all-to-all is in flight: shared (the combine, "
        "the experts' output on its way back, under the layer's shared experts; the routed "
        "sum waits for it after them) | chunks (as shared, and each layer's tokens split in "
        "two: one half's dispatch in flight while the other half's experts compute, then "
        "its combine; needs parallel.ep > 1) | none (each transfer waited for at once)",
        choices=("none", "shared", "chunks"),
    )
    cp_layout: str = arg(
        "zigzag",
        "how the sequence is split over cp ranks: zigzag (rank r holds chunks r and 2cp-1-r: "
        "equal causal work) | contiguous (chunk r) | balanced (with document masks: 8 chunks "
        "per rank chosen per micro-batch by their visible query-key pairs, largest first)",
        choices=("zigzag", "contiguous", "balanced"),
    )
    cp_kernel: str = arg(
        "auto",
        "block kernel of ring attention: auto (CPU: cpu_flash, or math with masks; CUDA: "
        "flex with masks, else sdpa_flash in bf16 with one head dim, else sdpa_efficient) | "
        "cpu_flash (CPU, one head dim, no mask) | math (exact fp32, dense block mask) | "
        "sdpa_flash (CUDA bf16, one head dim <= 256, no mask) | sdpa_efficient (CUDA, masks "
        "as a dense block bias) | sdpa_cudnn (CUDA bf16, no mask) | flex (CUDA "
        "FlexAttention: masks and windows without a dense mask) | flash_attn (flash-attn-4 on "
        "Hopper/Blackwell, bf16, no mask in the ring; also without CP, where it replaces "
        "the attention core: documents, windows and sinks included)",
        choices=(
            "auto",
            "cpu_flash",
            "math",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_cudnn",
            "flex",
            "flash_attn",
        ),
    )
    pp: int = arg(
        1,
        "pipeline-parallel degree: the blocks cut into stages over pp groups of ranks (the "
        "outermost degree); a step's micro-batches flow through them",
        ge=1,
    )
    pp_schedule: str = arg(
        "1F1B",
        "pipeline schedule (torch.distributed.pipelining): 1F1B (one stage per rank) | "
        "Interleaved1F1B (parallel.pp_virtual_stages per rank, looped) | ZBVZeroBubble and "
        "DualPipeV (two stages per rank in a V, the backward split in input and weight parts)",
        choices=PP_SCHEDULES,
    )
    pp_virtual_stages: int = arg(
        2, "stages per rank under pp_schedule=Interleaved1F1B (the others fix theirs)", ge=1
    )
    pp_layers: list[int] = arg(
        [],
        "blocks of each pipeline stage, in order (their sum: the model's blocks before its "
        "head); [] = split by FLOPs",
        ge=1,
    )
    fsdp_gather: str = arg(
        "auto",
        "when FSDP gathers parameters and reduces gradients: auto (step where FSDP shards "
        "over one rank, where a gather is only a cast; micro_batch elsewhere) | micro_batch "
        "(gathered again for every micro-batch's forward and backward, gradients reduced per "
        "micro-batch: least memory) | step (gathered once per step and kept until the last "
        "micro-batch's backward, gradients accumulated unsharded in fp32 and reduced once: "
        "the bytes of one micro-batch, the memory of unsharded parameters and gradients)",
        choices=("auto", "micro_batch", "step"),
    )
