import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.common.recompute import recomputed


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: under `selective` recomputation its output and silu's are rebuilt in
    backward from gate and up (moetrain/models/common/recompute.py)."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x)). `bias`: each of the three
    projections has a bias (ERNIE-4.5's `use_bias`); off, they have none (most models).

    `rebuilt_projections`: under `selective` recomputation, gate and up are a recomputed
    region too, rebuilt in backward by their GEMMs from x rather than kept for SwiGLU's
    backward (MoE layers' shared experts: 2 x hidden bf16 values a token less per layer, for
    their two GEMMs again in each pass of backward that reads them)."""

    def __init__(
        self, dim: int, hidden_dim: int, bias: bool = False, rebuilt_projections: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.rebuilt_projections = rebuilt_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rebuilt_projections:
            gate, up = recomputed(self._project, x)
        else:
            gate, up = self._project(x)
        return self.down_proj(recomputed(swiglu, gate, up))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)
