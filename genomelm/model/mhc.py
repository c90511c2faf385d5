"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Before a block the streams are collapsed into the block input with weights `pre`; after it the block output is
spread back with weights `post` and added to the streams mixed by a doubly-stochastic `comb` (Sinkhorn). All three
weights come from a one-layer projection of the RMS-normed, flattened streams, computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .norms import unweighted_rms_norm


class HyperConnection(nn.Module):
    """Computes the mixing weights of one block. Parameters: `fn` [(2+N)*N, N*D], `base` [(2+N)*N], `scale` [3]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams: [B, S, N, D] -> post [B, S, N] fp32, comb [B, S, N, N] fp32, block input [B, S, D]."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
        comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, block_input


def sinkhorn(m: Tensor, iters: int, eps: float) -> Tensor:
    """Make m [..., N, N] (positive) near doubly stochastic: column sums, then `iters - 1` rounds of rows+columns."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def hc_combine(post: Tensor, comb: Tensor, block_output: Tensor, residual: Tensor) -> Tensor:
    """New streams [B, S, N, D]: `post[n] * block_output + sum_m comb[m, n] * residual[m]` (in residual's dtype)."""
    dtype = residual.dtype
    spread = post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2)
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


def hc_head(streams: Tensor) -> Tensor:
    """Final collapse of the streams: their unweighted mean. [B, S, N, D] -> [B, S, D]."""
    return streams.mean(dim=2)
