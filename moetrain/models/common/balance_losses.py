"""The routers' balance losses, from the statistics each MoE layer returns (`RouterStats`):
the Switch/GShard auxiliary loss, DeepSeek-V3's sequence-wise loss and ST-MoE's z-loss."""

from __future__ import annotations

import torch

from moetrain.models.common.moe import RouterStats


def stack_stats(per_layer: list[RouterStats]) -> RouterStats:
    """Per-layer stats -> one RouterStats with [L, B, E] ([L, B]) tensors."""
    ranked = [s.prob_topk_per_expert for s in per_layer]
    return RouterStats(
        torch.stack([s.tokens_per_expert for s in per_layer]),
        torch.stack([s.prob_sum for s in per_layer]),
        torch.stack([s.z_sum for s in per_layer]),
        per_layer[0].seq_len,
        per_layer[0].top_k,
        None if any(r is None for r in ranked) else torch.stack(ranked),
    )


def assignment_counts(stats: RouterStats, pooled: bool) -> torch.Tensor:
    """The assignment counts a balance loss's f is made of: the experts each router chose,
    or, pooled, the top-k of the unbiased probabilities, as Hugging Face's
    `load_balancing_loss_func` counts them (it takes the top-k of the softmax of the router
    logits: a selection-only bias is not in them). The two differ only for a router that
    chooses otherwise than by its probabilities (DeepSeek-V3's bias and group limits)."""
    if pooled and stats.prob_topk_per_expert is not None:
        return stats.prob_topk_per_expert
    return stats.tokens_per_expert


def load_balancing_loss(
    stats: RouterStats,
    num_experts: int,
    batch_counts: torch.Tensor | None = None,
    batch_rows: int | None = None,
    pooled: bool = False,
) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_le * P_le of each MoE layer l, averaged
    over the layers; f_le is the fraction of layer l's (token, top-k slot) assignments that
    went to expert e, P_le the mean router probability of e in that layer.

    NOTE: each layer on its own (Switch, GShard, Megatron-Core): a layer's overload is
    pushed down in that layer. `pooled=True` pools f and P over the layers' tokens before
    the product, as Hugging Face's `load_balancing_loss_func` does (its exact value, for
    parity): one layer's overload then cancels another's underload, and a layer whose
    experts starve can feel no pull at all (tests/test_balance_loss.py). Pooled, f counts
    the top-k of the unbiased probabilities, as there (`assignment_counts`).

    For a batch spread over ranks, pass `batch_counts` ([L, E], assignments summed over the
    ranks) and `batch_rows` (the tokens each layer routed, over the ranks): the result is
    this rank's share, and the shares of all ranks sum to the loss of the whole batch (the
    loss is linear in the probabilities, and f carries no gradient).
    """
    layers, batch = stats.prob_sum.shape[:2]
    rows = batch_rows if batch_rows is not None else batch * stats.seq_len
    counts = batch_counts if batch_counts is not None else assignment_counts(stats, pooled).sum(1)
    probs = stats.prob_sum.sum(1)  # [L, E] summed over this rank's tokens
    if pooled:
        rows = rows * layers
        return num_experts * torch.sum((counts.sum(0) / rows) * (probs.sum(0) / rows))
    # NOTE: the constant factors folded into one Python number: two launches here and two
    # in backward fewer than dividing each tensor by rows (equal to fp32 rounding).
    return torch.sum(counts * probs) * (num_experts / (rows * rows * layers))


def sequence_balance_loss(
    stats: RouterStats,
    seq_counts: torch.Tensor | None = None,
    seq_tokens: int | None = None,
    pooled: bool = False,
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, sum_e f_lbe * P_lbe per
    layer l and sequence b, averaged over the layers and summed over the sequences, with
    f = E / (K T) * (assignments to e in the sequence) and P = the sequence's mean
    normalised affinity to e (T tokens, top-K). `pooled=True` pools each sequence's counts
    and affinities over the layers first, its counts the top-k of the unbiased
    probabilities (see `load_balancing_loss`).

    For sequences split over context-parallel ranks pass `seq_counts` ([L, B, E] summed
    over those ranks) and `seq_tokens` (the whole sequence's T): the result is this rank's
    share (linear in P), and the ranks' shares sum to the value.
    """
    layers, _, num_experts = stats.prob_sum.shape
    counts = seq_counts if seq_counts is not None else assignment_counts(stats, pooled)
    tokens = seq_tokens if seq_tokens is not None else stats.seq_len
    probs = stats.prob_sum
    if pooled:  # one "layer" of L times the tokens: [L, B, E] -> [1, B, E]
        counts, probs = counts.sum(0, keepdim=True), probs.sum(0, keepdim=True)
        tokens, layers = tokens * layers, 1
    f = counts * (num_experts / (stats.top_k * tokens))
    return torch.sum(f * (probs / tokens)) / layers


def z_loss_sum(stats: RouterStats) -> torch.Tensor:
    """ST-MoE's router z-loss summed over this forward's tokens and averaged over the
    layers: sum_t logsumexp(router logits of t)^2 / L. Divided by the global batch's token
    count it is the z-loss, the mean over tokens (a share, like the token loss)."""
    return stats.z_sum.sum() / stats.z_sum.shape[0]
