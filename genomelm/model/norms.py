"""RMS normalisations used by GLM-5.3-Flash: weighted and sigmoid-gated.

All statistics are taken in fp32; the weighted norm returns `weight * normed.to(input dtype)` (the
checkpoint's convention), the gated norm stays in fp32 (fp64 for fp64 inputs) until its final cast.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .precision import at_least_fp32


class RMSNorm(nn.Module):
    """Weighted RMS norm over the last dimension (size `dim`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., dim] -> [..., dim] (x's dtype, promoted with the weight's)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS norm of x times `sigmoid(gate)`, in fp32 or wider (KDA's output norm, per head of size `dim`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        dtype = at_least_fp32(x.dtype)
        x32 = x.to(dtype)
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * normed * torch.sigmoid(gate.to(dtype))).to(x.dtype)
