"""Loss pieces of a training step: token cross-entropy sums and load-balancing loss shares
(DESIGN §6: every piece is a share, so that summed over forwards and ranks it is the value
one device would compute on the whole global batch)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.common.moe import RouterStats, load_balancing_loss, sequence_balance_loss
from parallelisms.mesh import ParallelDims
from trainer.data import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies (fp32) of logits [B, S, V] against labels [B, S]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def aux_loss_share(
    stats: RouterStats,
    mode: str,
    dims: ParallelDims,
    cp_group: dist.ProcessGroup,
    global_batch_size: int,
    rounds: int,
) -> torch.Tensor:
    """This forward's share of the step's aux loss (`moe.aux_loss_mode`).

    micro_batch: the Switch loss on one forward's sequences; global_batch: on those of all
    data-parallel ranks' forwards of the same accumulation round (`rounds` per step), as one
    device running their union; the step's value is the mean over forwards. sequence: the
    sequence-wise loss, mean over the global batch's sequences. Statistics spread over
    several ranks (the cp ranks of a sequence, or the whole batch) have their assignment
    counts all-reduced, and each rank adds its share (the losses are linear in the router
    probabilities and the counts carry no gradient).
    """
    layers, batch, num_experts = stats.prob_sum.shape  # [L, B, E]
    cp = dims.cp
    if mode == "sequence":
        counts = stats.tokens_per_expert
        if cp > 1:  # a sequence's counts over the cp ranks holding its parts
            counts = counts.clone()
            dist.all_reduce(counts, group=cp_group)
        return sequence_balance_loss(stats, counts, stats.seq_len * cp) / global_batch_size
    if mode == "global_batch":
        group, ranks, forwards = None, dims.world_size, rounds  # the whole batch
    else:
        group, ranks, forwards = cp_group, cp, rounds * dims.dp_size
    if ranks == 1:
        aux = load_balancing_loss(stats, num_experts)
    else:
        counts = stats.tokens_per_expert.sum((0, 1))
        dist.all_reduce(counts, group=group)
        rows = layers * batch * stats.seq_len * ranks
        aux = load_balancing_loss(stats, num_experts, counts, rows)
    return aux / forwards
