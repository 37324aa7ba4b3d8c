import torch
from torch import nn

from moetrain.models.common.recompute import recomputed


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in fp32 and cast back (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a region `selective` recomputation rebuilds (moetrain/models/common/recompute.py)
        return recomputed(self._normalize, x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
