"""Each token's sum over its routed rows, with a backward that keeps only the index.

`rows.new_zeros(T, dim).index_add_(0, token_of, rows)` under autograd saves `rows` (its
derivative formula expands the gradient `as(source)`), though the gradient of `rows` is
`grad[token_of]` and reads nothing of them. In an MoE layer those rows are the weighted
expert outputs (under expert parallelism, the combine's receive buffer): top-k rows of
the model width per token, the size of the experts' own input, kept for nothing. This
function runs the same forward and returns the same gradient (`index_select`, as the
formula does), saving only `token_of`.
"""

from __future__ import annotations

import torch


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_of: torch.Tensor, tokens: int) -> torch.Tensor:
        ctx.save_for_backward(token_of)
        # NOTE: out of place. torch 2.11's compile took `index_add_` into a fresh tensor for
        # an output of nothing: no gradient reached the rows (2.13 traces it right).
        return rows.new_zeros(tokens, rows.shape[1]).index_add(0, token_of, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (token_of,) = ctx.saved_tensors
        return grad.index_select(0, token_of), None, None


def sum_rows(rows: torch.Tensor, token_of: torch.Tensor, tokens: int) -> torch.Tensor:
    """rows [N, dim], token_of [N] -> [tokens, dim]: row i added to token token_of[i]."""
    return _SumRows.apply(rows, token_of, tokens)
