"""Drop-less mixture of experts: router -> permute by expert -> grouped GEMM -> un-permute.

The routed experts are one module holding stacked `[E, ...]` weights (`RoutedExperts`). It
takes the tokens, each (token, expert) assignment's token and routing weight in expert-major
order, and the count per expert, and returns each assignment's weighted output row; a second
module (`Unpermute`) sums them per token; a third, `Permute`, passes the routed tokens on.
Those three calls are the seams expert parallelism hooks into (all-to-all to the experts'
ranks and back, in flight while the layer computes something else); this file stays
mesh-agnostic.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.models.common.fp32_linear import fp32_linear
from moetrain.models.common.grouped_gemm import grouped_mm
from moetrain.models.common.mlp import SwiGLU, swiglu
from moetrain.models.common.recompute import recomputed
from moetrain.models.common.replay import recording
from moetrain.models.common.row_sum import sum_rows


class Routing(NamedTuple):
    """A router's output for tokens [T, dim]; every router returns one."""

    probs: torch.Tensor  # [T, E] fp32 affinities (what the balance losses read)
    top_weights: torch.Tensor  # [T, k] fp32, the weights of the chosen experts
    top_experts: torch.Tensor  # [T, k] expert ids
    logits: torch.Tensor  # [T, E] fp32 router logits before softmax/sigmoid (the z-loss)
    # [T, k] the top-k of `probs`, returned by a router that chooses otherwise (a
    # selection-only bias, group limits): what Hugging Face's pooled aux counts. None: the
    # chosen `top_experts` are that top-k (no second top-k per layer).
    ranked: torch.Tensor | None = None


class RouterStats(NamedTuple):
    """What MoE layers saw, per sequence, for load balancing and logging: [B, E] ([B] for
    z_sum) for one layer, [L, B, E] ([L, B]) for a model's L MoE layers stacked."""

    tokens_per_expert: torch.Tensor  # float, top-k assignments per expert (no grad)
    prob_sum: torch.Tensor  # fp32, router affinities summed over a sequence's tokens (grad)
    z_sum: torch.Tensor  # fp32, logsumexp(router logits)^2 summed over its tokens (grad)
    seq_len: int  # tokens of each sequence this rank routed
    top_k: int
    # float, the top-k of the unbiased `Routing.probs` per expert (no grad): what Hugging
    # Face's pooled aux loss counts. It differs from tokens_per_expert where the router
    # chooses otherwise (a selection-only bias, group limits). None: the same counts.
    prob_topk_per_expert: torch.Tensor | None = None


@dataclass(frozen=True)
class MoEOptions:
    """Run-time choices of the MoE layers that do not change the weights."""

    gemm: str = "auto"  # see grouped_mm
    capacity_factor: float | None = None  # None: drop-less
    # The router z-loss trains the routers: its sums carry gradients. Off, they are only
    # measured (no autograd graph, which would keep each layer's [T, E] fp32 logits alive).
    z_loss: bool = False
    # Pieces a layer's tokens are split in between routing and the sum (>= 1). Each goes
    # through `permute` before any reaches the experts, so that under expert parallelism
    # one piece's transfer runs while another's experts compute (parallel.ep_overlap).
    chunks: int = 1


class TopKRouter(nn.Module):
    """Softmax router in fp32, top-k, optional renormalisation of the top-k weights (which
    equals a softmax over the top-k logits: GPT-OSS's router), optional logit bias."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool, bias: bool = False
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, dim] -> softmax probabilities [T, E] and the top-k among them."""
        logits = fp32_linear(x, self.weight, self.bias)
        probs = logits.softmax(dim=-1)
        top_weights, top_experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return Routing(probs, top_weights, top_experts, logits)


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3 routing: sigmoid affinities in fp32, experts chosen by affinity plus a
    correction bias, within the `topk_group` best of `n_group` expert groups (a group
    scores the sum of its two best biased affinities). The bias steers selection only;
    the weights are the unbiased affinities, optionally renormalised, times
    `routed_scaling_factor`.

    Buffers: `e_score_correction_bias` [E] (fp32) and `tokens_per_expert` [E] (int64, the
    assignments counted in training forwards since the last bias update; a replayed forward,
    `moetrain.models.common.replay`, is not counted again). The trainer's optimizer pre-step hook
    turns the counts into the aux-loss-free bias update; it finds a router by these two
    buffers (`moetrain.models.spec.BiasBuffers`), so a router of any class that registers them takes
    part.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, dim] -> normalised affinities [T, E] (for the aux losses) and the top-k
        experts with their (unbiased, scaled) weights."""
        logits = fp32_linear(x, self.weight)  # [T, E]
        scores = logits.sigmoid()
        biased = (scores + self.e_score_correction_bias).detach()
        grouped = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        best_groups = group_scores.topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        top_experts = biased.topk(self.top_k, dim=-1).indices  # [T, k]
        top_weights = scores.gather(1, top_experts)
        if self.norm_topk_prob:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        top_weights = top_weights * self.routed_scaling_factor
        # A training forward (not an eval probe), counted once: activation checkpointing's
        # replay of it in backward routes the same tokens again (moetrain.models.common.replay).
        if recording(self):
            with torch.no_grad():
                # NOTE: not bincount: its output length depends on the data, which breaks
                # a torch.compile graph; this one is [E] by construction.
                chosen = top_experts.flatten()
                self.tokens_per_expert.index_add_(0, chosen, torch.ones_like(chosen))
        ranked = scores.topk(self.top_k, dim=-1).indices  # the unbiased top-k [T, k]
        probs = scores / scores.sum(-1, keepdim=True)
        return Routing(probs, top_weights, top_experts, logits, ranked)


class RoutedExperts(nn.Module, abc.ABC):
    """E experts with stacked weights, called on routed tokens (the seam expert parallelism
    wraps). A subclass defines `ffn`, the experts' arithmetic on expert-major rows."""

    @abc.abstractmethod
    def ffn(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted [N, dim] expert-major, tokens_per_expert [E_local] -> [N, dim]."""

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        token_of: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [R, dim] rows; the N assignments in expert-major order: token_of [N] (the row of
        each; None: row i is assignment i, N = R), weights [N] (None: 1) and
        tokens_per_expert [E_local] -> [N, dim], each assignment's weighted output."""
        rows = x if token_of is None else x[token_of]  # [N, dim] expert-major
        y = self.ffn(rows, tokens_per_expert)
        if weights is not None:
            y = y * weights[:, None].to(y.dtype)
        return y


class Permute(nn.Module):
    """The routed tokens on their way to the experts: (x [T, dim], tokens_per_expert [E],
    token_of [N], weights [N]), passed on as they are.

    No work in one process. A module of its own so that expert parallelism can hook the
    point where a chunk's tokens leave: it starts their dispatch there, before the experts
    of the chunk before it run (`MoEOptions.chunks`)."""

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        token_of: torch.Tensor,
        weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return x, tokens_per_expert, token_of, weights


class Unpermute(nn.Module):
    """Each token's sum over its assignments' rows: rows [N, dim], token_of [N] -> [T, dim].

    A module of its own (no parameters) so that expert parallelism can hook the point where
    the routed output is first needed: it waits there for the combine in flight."""

    def forward(self, rows: torch.Tensor, token_of: torch.Tensor, tokens: int) -> torch.Tensor:
        return sum_rows(rows, token_of, tokens)


class GroupedExperts(RoutedExperts):
    """E SwiGLU experts with stacked weights, in nn.Linear's (out, in) orientation:
    gate_up_proj [E, 2 * hidden, dim] (gate rows first), down_proj [E, dim, hidden]."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, gemm: str = "auto") -> None:
        super().__init__()
        self.gemm = gemm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def ffn(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x_sorted, "gate_up", tokens_per_expert).chunk(2, dim=-1)
        hidden = recomputed(swiglu, gate, up)
        # NOTE: the down-projection is a recomputed region too: its output (top-k rows of
        # the model width a token), which the routing weights' product keeps for their
        # gradient, is rebuilt in backward by its GEMM rather than kept; and its input,
        # SwiGLU's output, is rebuilt from SwiGLU's region alone where only it is needed
        # (the weight gradient: the split backward's weight pass runs no GEMM again).
        return recomputed(self._down, hidden, tokens_per_expert)

    def _down(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.project(hidden, "down", tokens_per_expert)

    def project(self, x: torch.Tensor, name: str, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows [N, in] through each one's expert's `{name}_proj` ("gate_up" or "down")."""
        w = getattr(self, f"{name}_proj")
        if isinstance(w, DTensor):
            # NOTE: under expert parallelism the weights are DTensors sharded on the expert
            # dim; the dispatcher already delivered exactly the tokens of the local experts.
            w = w.to_local()
        return grouped_mm(x, w.transpose(-2, -1), tokens_per_expert, self.gemm)


class MoE(nn.Module):
    """Drop-less token-choice MoE: every token reaches its top-k experts, plus (optionally)
    shared experts that every token goes through, optionally scaled per token by a sigmoid
    gate (Qwen2-MoE's `shared_expert_gate`).

    `router` maps tokens [T, dim] to a `Routing` and has `num_experts` and `top_k`
    (TopKRouter, GroupLimitedRouter, moetrain.models.common.bias_router.BiasedSoftmaxRouter).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        router: nn.Module,
        options: MoEOptions | None = None,
        shared_hidden_dim: int = 0,
        experts: RoutedExperts | None = None,
        shared_gate: bool = False,
        shared_bias: bool = False,
    ) -> None:
        """dim: model width; hidden_dim: each routed expert's hidden width; options: the
        run-time choices (`MoEOptions`). shared_hidden_dim: the shared experts' hidden width,
        one SwiGLU `shared_experts` (0 = none; several shared experts of width I are one of
        width n * I). `experts`: the routed experts, a `RoutedExperts` with stacked `[E, ...]`
        parameters (default: `GroupedExperts`, SwiGLU). shared_gate: scale the shared
        experts' output by sigmoid(`shared_expert_gate`(x)), a [1, dim] linear map.
        shared_bias: the shared experts' projections have biases (ERNIE-4.5's `use_bias`)."""
        super().__init__()
        options = options or MoEOptions()
        self.num_experts = router.num_experts
        self.top_k = router.top_k
        self.capacity_factor = options.capacity_factor
        self.z_loss = options.z_loss
        self.chunks = options.chunks
        self.gate = router
        self.experts = experts or GroupedExperts(self.num_experts, dim, hidden_dim, options.gemm)
        self.shared_experts = (
            SwiGLU(dim, shared_hidden_dim, shared_bias, rebuilt_projections=True)
            if shared_hidden_dim
            else None
        )
        if shared_gate and not shared_hidden_dim:
            raise ValueError("shared_gate needs shared experts (shared_hidden_dim > 0)")
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.permute = Permute()
        self.unpermute = Unpermute()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x [B, S, dim] -> (y [B, S, dim], per-sequence routing statistics)."""
        B, S, dim = x.shape
        x_flat = x.reshape(-1, dim)  # [T = B*S, dim]
        routing = self.gate(x_flat)
        probs, top_weights, top_experts, logits = routing[:4]

        # Permute the T*k (token, expert) assignments expert-major.
        flat_experts = top_experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # assignment ids, expert-major
        # [B, E] assignments, counted in fp32 (exact to 2^24 a sequence) as the statistics
        # want them. NOTE: not the scalar `scatter_(..., 1.0, reduce="add")`, a launch fewer:
        # inductor lowers it with the ones shaped like the output, not like the index, and
        # the compiled block fails (torch 2.11-2.13).
        per_seq = torch.zeros(B, self.num_experts, dtype=torch.float32, device=x.device)
        one = per_seq.new_ones(())
        per_seq.scatter_add_(1, top_experts.reshape(B, -1), one.expand(B, S * self.top_k))
        tokens_per_expert = per_seq.sum(0, dtype=torch.int64)  # [E]
        ranked = routing.ranked  # None: the router chose by its probabilities' top-k
        if ranked is not None:
            ranked = torch.zeros_like(per_seq).scatter_add_(
                1, ranked.view(B, -1), one.expand(B, S * self.top_k)
            )
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.z_loss):
            z_sum = torch.logsumexp(logits, dim=-1).square().view(B, S).sum(1)  # [B]
        stats = RouterStats(per_seq, probs.view(B, S, -1).sum(1), z_sum, S, self.top_k, ranked)
        if self.capacity_factor is not None:
            order, tokens_per_expert = self._drop_over_capacity(order, tokens_per_expert)
        token_of = order // self.top_k  # source token of each sorted assignment

        weights = top_weights.reshape(-1)[order]  # [assignments], expert-major
        chunks = self._chunks(B * S, flat_experts, order, token_of, weights, tokens_per_expert)
        # One chunk: all of x_flat (its slice would cost a launch and one in backward).
        sent = [
            self.permute(x_flat if len(chunks) == 1 else x_flat[t0:t1], *routed)
            for (t0, t1), routed in chunks
        ]
        rows = [self.experts(*routed) for routed in sent]  # each [N_chunk, dim]
        # NOTE: the shared experts run before the routed rows are summed: under expert
        # parallelism the rows' way back (the combine) is still in flight until `unpermute`.
        shared = None if self.shared_experts is None else self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # gate [B, S, 1]
        ys = [
            self.unpermute(piece_rows, piece_token_of, t1 - t0)  # [t1 - t0, dim]
            for piece_rows, ((t0, t1), (_, piece_token_of, _)) in zip(rows, chunks, strict=True)
        ]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys)).view(B, S, dim)
        return (y if shared is None else y + shared), stats

    def _chunks(self, tokens, flat_experts, order, token_of, weights, tokens_per_expert):
        """The sorted assignments (`order` of `flat_experts`) split by token into
        `self.chunks` contiguous pieces: [((t0, t1), (tokens_per_expert, token_of - t0,
        weights))], each piece's assignments still expert-major. Each token lies in one
        piece, so its rows are summed in the same order as unsplit."""
        if self.chunks == 1:
            return [((0, tokens), (tokens_per_expert, token_of, weights))]
        expert_of = flat_experts[order]
        starts = [(c * tokens + self.chunks - 1) // self.chunks for c in range(self.chunks + 1)]
        piece = token_of * self.chunks // tokens  # [N]: token t is in piece t * chunks // T
        by_piece = torch.argsort(piece, stable=True)  # expert-major inside each piece
        sizes = torch.zeros(self.chunks, dtype=piece.dtype, device=piece.device)
        sizes = sizes.index_add_(0, piece, torch.ones_like(piece)).tolist()  # host read
        out = []
        for c, ids in enumerate(torch.split(by_piece, sizes)):
            ones = torch.ones_like(ids)
            counts = torch.zeros_like(tokens_per_expert).index_add_(0, expert_of[ids], ones)
            routed = (counts, token_of[ids] - starts[c], weights[ids])
            out.append(((starts[c], starts[c + 1]), routed))
        return out

    def _drop_over_capacity(
        self, order: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GShard capacity: each expert keeps its first ceil(cf * T * k / E) assignments in
        token order; the rest are dropped (the residual stream carries those tokens)."""
        capacity = math.ceil(self.capacity_factor * order.numel() / self.num_experts)
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert  # [E]
        expert_of = torch.repeat_interleave(tokens_per_expert)  # expert of each sorted slot
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert_of]
        return order[rank_in_expert < capacity], tokens_per_expert.clamp(max=capacity)
