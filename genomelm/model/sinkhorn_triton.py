"""mHC's Sinkhorn normalisation as one Triton kernel each way (`mhc_backend="triton"`), the torch path being
`mhc._Sinkhorn`.

For m [N, N, T] fp32 (token-minor, N = hc_mult), each program takes a tile of tokens [N, N, BT] into registers
and runs every step there: column sums, then `iters - 1` rounds of rows + columns, each step
x / (sum_axis x + eps). The torch path issues three kernels per step (sum, add, divide): 2 x iters - 1 = 39
steps at iters = 20, 117 kernels for the forward and as many again for each recompute, and its backward three
times that (the iterates again, then six per step), per hyper-connection; here one kernel each way.

The backward recomputes the iterate entering each step from m (the step's input is what its gradient needs),
walking the steps backwards: (2 x iters - 1)^2 / 2 normalisations of a [N, N] tile per token, all in
registers, reading m and the gradient once and writing d m once. For a step y = x / (sum_axis x + eps):
d x = (d y - sum_axis(d y * y)) / (sum_axis x + eps), as `mhc._Sinkhorn.backward`.

The custom ops (`genomelm::mhc_sinkhorn`, `genomelm::mhc_sinkhorn_backward`) have fake implementations (the
planner traces them) and no FLOP formula: like the torch path's elementwise steps, they are costed by the
bytes they move (the roofline's default: their tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .mhc_triton import MAX_HC_MULT, _pow2
from .mhc_triton import _sum as _tile_sum

SINKHORN_TOKENS = 64  # tokens per program: [N, N, 64] fp32 tiles (4 KiB at N = 4, 16 KiB at N = 8)


@triton.jit
def _normalise(x, axis: tl.constexpr, eps):
    """x / (sum_axis x + eps) for a tile [NP, NP, BT]."""
    return x / (tl.expand_dims(_tile_sum(x, axis), axis) + eps)


@triton.jit
def _step(x, step, eps):
    """Sinkhorn step `step` on x: column sums (axis 0) at even steps, row sums (axis 1) at odd ones."""
    if step % 2 == 0:
        out = _normalise(x, 0, eps)
    else:
        out = _normalise(x, 1, eps)
    return out


@triton.jit
def _step_backward(g, x, step, eps):
    """d x of Sinkhorn step `step` from its input x and d y = g: (g - sum_axis(g y)) / (sum_axis x + eps)."""
    if step % 2 == 0:
        denominator = tl.expand_dims(_tile_sum(x, 0), 0) + eps
        out = (g - tl.expand_dims(_tile_sum(g * (x / denominator), 0), 0)) / denominator
    else:
        denominator = tl.expand_dims(_tile_sum(x, 1), 1) + eps
        out = (g - tl.expand_dims(_tile_sum(g * (x / denominator), 1), 1)) / denominator
    return out


@triton.jit
def _tile(T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """Offsets and mask of this program's tile of an [N, N, T] tensor (padded rows and columns masked)."""
    rows = tl.arange(0, NP)
    cols = tl.arange(0, NP)
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    offsets = rows[:, None, None] * (N * T) + cols[None, :, None] * T + tokens[None, None, :].to(tl.int64)
    mask = (rows < N)[:, None, None] & (cols < N)[None, :, None] & (tokens < T)[None, None, :]
    return offsets, mask


@triton.jit
def _sinkhorn_fwd_kernel(m_ptr, out_ptr, T, steps, eps, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    offsets, mask = _tile(T, N, NP, BT)
    x = tl.load(m_ptr + offsets, mask=mask, other=0.0)  # padding stays 0: it adds nothing to any sum
    for step in range(0, steps):
        x = _step(x, step, eps)
    tl.store(out_ptr + offsets, x, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(
    g_ptr, m_ptr, gm_ptr, T, steps, eps, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr
):
    offsets, mask = _tile(T, N, NP, BT)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0)
    for back in range(0, steps):
        step = steps - 1 - back
        x = m
        for before in range(0, step):  # the iterate entering `step`
            x = _step(x, before, eps)
        g = _step_backward(g, x, step, eps)
    tl.store(gm_ptr + offsets, g, mask=mask)


def _steps(iters: int) -> int:
    """Normalisation steps of `iters` Sinkhorn iterations (`mhc._sinkhorn_axes`)."""
    return 2 * iters - 1


def _check(m: Tensor) -> None:
    n = m.shape[0]
    if m.dim() != 3 or m.shape[1] != n or m.dtype != torch.float32 or n > MAX_HC_MULT:
        raise ValueError(
            f"the Sinkhorn kernel takes fp32 m [N, N, T] with N <= {MAX_HC_MULT}, got {m.dtype} of shape "
            f"{tuple(m.shape)}: set mhc_backend=torch"
        )


@torch.library.custom_op("genomelm::mhc_sinkhorn", mutates_args=())
def mhc_sinkhorn(m: Tensor, iters: int, eps: float) -> Tensor:
    """m [N, N, T] fp32, positive, contiguous -> its Sinkhorn normalisation [N, N, T] fp32."""
    n, _, tokens = m.shape
    out = torch.empty_like(m)
    grid = (triton.cdiv(tokens, SINKHORN_TOKENS),)
    _sinkhorn_fwd_kernel[grid](m, out, tokens, _steps(iters), eps, n, _pow2(n), SINKHORN_TOKENS)
    return out


@mhc_sinkhorn.register_fake
def _(m: Tensor, iters: int, eps: float) -> Tensor:
    return torch.empty_like(m)


@torch.library.custom_op("genomelm::mhc_sinkhorn_backward", mutates_args=())
def mhc_sinkhorn_backward(grad: Tensor, m: Tensor, iters: int, eps: float) -> Tensor:
    """d out [N, N, T] fp32 (contiguous) and the forward's m -> d m [N, N, T] fp32."""
    n, _, tokens = m.shape
    grad_m = torch.empty_like(m)
    grid = (triton.cdiv(tokens, SINKHORN_TOKENS),)
    _sinkhorn_bwd_kernel[grid](grad, m, grad_m, tokens, _steps(iters), eps, n, _pow2(n), SINKHORN_TOKENS)
    return grad_m


@mhc_sinkhorn_backward.register_fake
def _(grad: Tensor, m: Tensor, iters: int, eps: float) -> Tensor:
    return torch.empty_like(m)


def _setup(ctx: Any, inputs: tuple[Tensor, int, float], output: Tensor) -> None:
    m, ctx.iters, ctx.eps = inputs
    ctx.save_for_backward(m)


def _autograd(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    (m,) = ctx.saved_tensors
    return mhc_sinkhorn_backward(grad.contiguous(), m, ctx.iters, ctx.eps), None, None


mhc_sinkhorn.register_autograd(_autograd, setup_context=_setup)


def sinkhorn(m: Tensor, iters: int, eps: float) -> Tensor:
    """`mhc._Sinkhorn.apply(m, iters, eps)` on the kernels: m [N, N, T] fp32 -> [N, N, T] fp32."""
    _check(m)
    return mhc_sinkhorn(m.contiguous(), iters, eps)
