"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Before a block the streams are collapsed into the block input with weights `pre`; after it the block output
is spread back with weights `post` and added to the streams mixed by a doubly-stochastic `comb` (Sinkhorn).
All three weights come from a one-layer projection of the RMS-normed, flattened streams, computed in fp32.

Precision: the streams are stored in the compute dtype (bf16 under bf16 autocast: 2 bytes per value, the
tensor a layer keeps for its recompute), while the mixing weights, the Sinkhorn iterations, the collapse into
the block input and the combine after the block all run in fp32 with autocast off, rounding once on the way
out.

Two paths (`RunOptions.mhc_backend`): the torch path below (the reference, any device) casts the streams to
fp32 copies; the Triton kernels (`mhc_triton`, "auto" on CUDA) read the streams in their stored dtype and keep
the fp32 arithmetic in registers. For one block at T = 64k tokens with N = 4 streams of D = 4096 (bf16
streams: 2 GiB) the torch path's forward peaks 24.5 GiB above the streams (5 GiB in the mix + collapse, 19 GiB
more in the combine: fp32 copies of the streams, `spread`, `mixed`) and keeps 12 GiB for the backward; the
kernels' forward allocates only its outputs (3.5 GiB, the 1 GiB fp32 block input and the 2 GiB new streams
among them) and saves no copy (details in `mhc_triton`). Both paths share the per-token weights
(`HyperConnection._weights`, tensors of [T, (2+N)*N]).

Speed on the CPU: the per-token weights are tiny ([N], [N, N] with N = 4), so they are computed token-minor
([.., T] with the T = B*S tokens last and contiguous): every elementwise op of the Sinkhorn iterations then
runs over long contiguous rows instead of 4-wide ones. The RMS norm is folded into the projection
(`_NormedMix`) and the Sinkhorn iterations have a hand-written backward that recomputes them (`_Sinkhorn`); on
the Triton path they run as one kernel each way (`sinkhorn_triton`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .backends import TRITON, resolve_backend
from .config import ModelConfig, RunOptions
from .precision import at_least_fp32, fp32_region

SINKHORN_BACKWARD_TOKENS = 16384  # tokens whose Sinkhorn iterates are recomputed and held at once in backward


class HyperConnection(nn.Module):
    """Computes the mixing weights of one block, collapses the streams into its input (`forward`) and spreads
    its output back (`combine`).

    Parameters: `fn` [(2+N)*N, N*D], `base` [(2+N)*N] fp32, `scale` [3] fp32. `RunOptions.mhc_backend` picks
    the torch path (fp32 copies of the streams) or the Triton kernels (`mhc_triton`: the streams stay in their
    dtype), resolved at the first forward from the streams' device and named in `route`.
    """

    def __init__(self, config: ModelConfig, options: RunOptions) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.requested_backend = options.mhc_backend
        self.backend: str | None = None  # resolved at the first forward, on the streams' device
        self.route = f"mhc: {options.mhc_backend} (resolved at the first forward)"

    def resolve_backend(self, streams: Tensor) -> str:
        """The backend for streams like `streams`, chosen at the first call; names it in `route`."""
        if self.backend is None:
            self.backend = resolve_backend(
                "mhc_backend", self.requested_backend, (TRITON, "torch"), "torch", streams.device
            )
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
                streams.dtype, str(streams.dtype).removeprefix("torch.")
            )
            self.route = (
                f"mhc: triton fused ({dtype} streams)"
                if self.backend == TRITON
                else "mhc: torch (fp32 copies)"
            )
        return self.backend

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [B, S, N, D] -> post [B, S, N], comb [B, S, N, N], block input [B, S, D], all fp32."""
        triton_path = self.resolve_backend(streams) == TRITON
        with fp32_region(streams):
            return (
                self._mix_triton(streams)
                if triton_path
                else self._mix(streams.to(at_least_fp32(streams.dtype)))
            )

    def combine(self, post: Tensor, comb: Tensor, block_output: Tensor, residual: Tensor) -> Tensor:
        """New streams [B, S, N, D] from this block's weights (see `hc_combine`), in residual's dtype."""
        if self.resolve_backend(residual) == TRITON:
            from . import mhc_triton

            with fp32_region(residual):
                return mhc_triton.combine(post, comb, block_output, residual)
        return hc_combine(post, comb, block_output, residual)

    def _weights(self, mixes: Tensor, kernels: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """mixes [(2+N)*N, T] fp32 (token-minor) -> pre [N, T], post [N, T], comb [N, N, T]; the Sinkhorn on
        its Triton kernels with `kernels` (`sinkhorn_triton`), else `_Sinkhorn`."""
        n = self.hc_mult
        pre_w, post_w, comb_w = mixes.split([n, n, n * n])
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b[:, None]) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b[:, None])
        comb_logits = comb_w.unflatten(0, (n, n)) * comb_s + comb_b.view(n, n, 1)
        positive = torch.softmax(comb_logits, dim=1) + self.hc_eps
        if kernels:
            from . import sinkhorn_triton

            return pre, post, sinkhorn_triton.sinkhorn(positive, self.sinkhorn_iters, self.hc_eps)
        return pre, post, _Sinkhorn.apply(positive, self.sinkhorn_iters, self.hc_eps)

    def _mix(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.hc_mult
        batch, seq_len = streams.shape[:2]
        flat = streams.flatten(2).flatten(0, 1)  # [T, N*D]
        mixes = _NormedMix.apply(flat, self.fn.to(flat.dtype), self.norm_eps).T  # [(2+N)*N, T], token-minor
        pre, post, comb = self._weights(mixes)
        # back to token-major (small copies) so the batched matmuls over tokens see contiguous matrices
        mix_in = pre.T.contiguous().view(batch, seq_len, 1, n)
        block_input = torch.matmul(mix_in, streams).squeeze(-2)
        return (
            post.T.contiguous().view(batch, seq_len, n),
            comb.permute(2, 0, 1).contiguous().view(batch, seq_len, n, n),
            block_input,
        )

    def _mix_triton(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from . import mhc_triton

        n = self.hc_mult
        batch, seq_len = streams.shape[:2]
        mixes = mhc_triton.mix(streams, self.fn.float(), self.norm_eps).T  # [(2+N)*N, T], token-minor
        pre, post, comb = self._weights(mixes, kernels=True)
        return (
            post.T.contiguous().view(batch, seq_len, n),
            comb.permute(2, 0, 1).contiguous().view(batch, seq_len, n, n),
            mhc_triton.collapse(streams, pre.T),
        )


class _NormedMix(torch.autograd.Function):
    """mixes = (x / rms(x)) @ fn^T, computed as rsqrt(mean(x^2) + eps) * (x @ fn^T).

    x [T, K] fp32, fn [M, K] fp32 -> [T, M] fp32. The backward is written out, so no normalised copy of x is
    ever stored or recomputed: d x = r (g @ fn) - (r^3 / K) (g . raw) x with raw = x @ fn^T, r the inverse
    RMS.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Tensor, eps: float) -> Tensor:
        raw = x @ fn.T
        width = x.shape[-1]
        inv_rms = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / width + eps)
        ctx.save_for_backward(x, fn, raw, inv_rms)
        return raw * inv_rms

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, fn, raw, inv_rms = ctx.saved_tensors
        grad_scaled = grad * inv_rms
        grad_x = grad_fn = None
        if ctx.needs_input_grad[0]:
            coefficient = (grad * raw).sum(-1, keepdim=True) * inv_rms.pow(3) / -x.shape[-1]
            grad_x = torch.addcmul(grad_scaled @ fn, x, coefficient)
        if ctx.needs_input_grad[1]:
            grad_fn = grad_scaled.T @ x
        return grad_x, grad_fn, None


def _sinkhorn_axes(iters: int) -> list[int]:
    """Summed axis of each normalisation step on [N(row), N(col), T]: 0 = column sums, 1 = row sums."""
    return [0] + [1, 0] * (iters - 1)


def _sinkhorn_iterates(m: Tensor, iters: int, eps: float) -> list[Tensor]:
    """[m, after step 1, ..., after the last step] for m [N, N, T]."""
    out = [m]
    for axis in _sinkhorn_axes(iters):
        out.append(out[-1] / (out[-1].sum(dim=axis, keepdim=True) + eps))
    return out


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn normalisation of positive m [N, N, T] (token-minor) towards doubly stochastic -> [N, N, T]:
    column sums, then `iters - 1` rounds of rows + columns, each step x / (sum_axis x + eps).

    Backward recomputes the iterates, SINKHORN_BACKWARD_TOKENS tokens at a time; for a step
    y = x / (sum_axis x + eps): d x = (d y - sum_axis(d y * y)) / (sum_axis x + eps).
    """

    @staticmethod
    def forward(ctx: Any, m: Tensor, iters: int, eps: float) -> Tensor:
        ctx.save_for_backward(m)
        ctx.iters, ctx.eps = iters, eps
        return _sinkhorn_iterates(m, iters, eps)[-1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (m,) = ctx.saved_tensors
        grad = grad.contiguous()
        axes = _sinkhorn_axes(ctx.iters)
        grad_m = torch.empty_like(m)
        for start in range(0, m.shape[-1], SINKHORN_BACKWARD_TOKENS):
            part = slice(start, start + SINKHORN_BACKWARD_TOKENS)
            iterates = _sinkhorn_iterates(m[..., part], ctx.iters, ctx.eps)
            g = grad[..., part]
            for step in range(len(axes) - 1, -1, -1):
                axis, x, y = axes[step], iterates[step], iterates[step + 1]
                g = (g - (g * y).sum(dim=axis, keepdim=True)) / (x.sum(dim=axis, keepdim=True) + ctx.eps)
            grad_m[..., part] = g
        return grad_m, None, None


def hc_combine(post: Tensor, comb: Tensor, block_output: Tensor, residual: Tensor) -> Tensor:
    """New streams [B, S, N, D]: `post[n] * block_output + sum_m comb[m, n] * residual[m]`, computed in fp32
    (fp64 for fp64 streams) and returned in residual's dtype. The torch path."""
    dtype = at_least_fp32(residual.dtype)
    with fp32_region(residual):
        spread = post.to(dtype).unsqueeze(-1) * block_output.to(dtype).unsqueeze(-2)
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), residual.to(dtype))
        return (spread + mixed).to(residual.dtype)


def hc_head(streams: Tensor) -> Tensor:
    """Final collapse of the streams: their unweighted mean. [B, S, N, D] -> [B, S, D] fp32."""
    return streams.float().mean(dim=2)
