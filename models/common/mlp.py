import torch
import torch.nn.functional as F
from torch import nn

from models.common.recompute import recomputed


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: under `selective` recomputation its output and silu's are rebuilt in
    backward from gate and up (models/common/recompute.py)."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x)). `bias`: each of the three
    projections has a bias (ERNIE-4.5's `use_bias`); off, they have none (most models)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(recomputed(swiglu, self.gate_proj(x), self.up_proj(x)))
