"""mHC's three stream passes as Triton kernels (`mhc_backend="triton"`): the streams keep their stored dtype.

With T tokens, N = hc_mult streams of width D (K = N*D) and M = (2+N)*N mixing weights per token:
- mix: `mixes [T, M] = x / rms(x) @ fn^T` for the flattened streams x [T, K], with the sum of squares taken in
  the same pass (`_NormedMix`'s numbers);
- collapse: `block input [T, D] = sum_n pre[t, n] * streams[t, n, :]`, returned fp32 as the torch path does;
- combine: `new streams [T, N, D] = post[t, n] * out[t, :] + sum_m comb[t, m, n] * residual[t, m, :]`,
  returned in the residual's dtype.
Every kernel loads its operands in their stored dtype, computes in fp32 registers (fp32 `tl.dot` in IEEE
precision, as the torch path's fp32 matmuls are not TF32) and writes once. The per-token weights in between
(sigmoids, softmax on [T, M]-sized tensors) stay in torch (`HyperConnection._weights`); the Sinkhorn has its
own kernels (`sinkhorn_triton`).

Each pass and its backward is a torch custom op (`genomelm::mhc_*`) with a fake implementation, an autograd
formula and a FLOP formula, and `*_bytes` estimates the HBM traffic of each from the shapes.

Memory at T tokens, bf16 streams, N = 4, D = 4096 (2 GiB of streams at T = 64k; measured at 64k on fake
tensors with torch's MemTracker, one hyper-connected block: mix, collapse, an identity block, combine).
The torch path materialises fp32 copies: the mix + collapse peak 5 GiB above the streams (`streams.float()`,
4 GiB, kept for the backward, plus the 1 GiB fp32 block input); the combine adds `residual.float()`, `spread`,
`mixed` and their sum (4 GiB each) beside the fp32 block output, 19 GiB more at its peak, so the block's
forward peaks at 24.5 GiB and leaves 12 GiB alive for the backward. The kernels' forward allocates its outputs
only (the 1 GiB fp32 block input, the 2 GiB new streams, and [T, M]-sized fp32 weights: 6 MiB each): 3.5 GiB
with the block input's bf16 cast, all of it outputs, no copy saved. Their backward writes each stream
gradient once in the streams' dtype (2 GiB each, three summed by autograd) plus fp32 partial sums of `grad fn`
(at most 64 x M x K x 4 bytes, 96 MiB): forward + backward peak 11 GiB against the torch path's 24.5 GiB.

Fixed block sizes (no autotuning: it needs a GPU driver, and the interpreter tests run one config).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

MAX_HC_MULT = 8  # N beyond this would not fit the [N, N] tiles of the combine's backward in registers
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FN_SPLITS_MAX = 64  # token splits of the `grad fn` reduction (fp32 partials summed in torch)

MIX_TOKENS, MIX_WIDTH = 32, 128
STREAM_TOKENS, STREAM_WIDTH = 16, 128  # collapse and the combine's forward
COMBINE_BWD_TOKENS, COMBINE_BWD_WIDTH = 4, 128


def check_streams(streams: Tensor) -> None:
    """Raise ValueError naming the shape or dtype if the kernels cannot take streams [B, S, N, D]."""
    if streams.dim() != 4:
        raise ValueError(f"mhc triton kernels take streams [B, S, N, D], got shape {tuple(streams.shape)}")
    if streams.dtype not in DTYPES:
        raise ValueError(
            f"mhc_backend=triton takes fp32/fp16/bf16 streams, got {streams.dtype} of shape "
            f"{tuple(streams.shape)}: set mhc_backend=torch"
        )
    if streams.shape[2] > MAX_HC_MULT:
        raise ValueError(
            f"mhc_backend=triton takes at most {MAX_HC_MULT} streams, got hc_mult={streams.shape[2]} "
            f"(streams {tuple(streams.shape)}): set mhc_backend=torch"
        )


def _pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)


# --------------------------------------------------------------------------------------------- kernels
# `tl.sum` and `tl.zeros` are @triton.jit functions of Triton's standard library, decorated when
# triton.language is first imported: if that came before TRITON_INTERPRET=1 was set (torch._dynamo imports
# triton), the interpreter cannot call them. The kernels use builtins instead, which run in both modes.
@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _mix_fwd_kernel(
    x_ptr, fn_ptr, mixes_ptr, inv_rms_ptr, T, K, M, eps, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    acc = tl.full([BT, MP], 0.0, tl.float32)
    squares = tl.full([BT], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        x = x.to(tl.float32)
        w = tl.load(
            fn_ptr + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & (cols < M)[None, :], other=0.0
        )
        acc = tl.dot(x, w, acc, input_precision="ieee")
        squares += _sum(x * x, 1)
    inv_rms = tl.rsqrt(squares / K + eps)
    out = mixes_ptr + rows64[:, None] * M + cols[None, :]
    tl.store(out, acc * inv_rms[:, None], mask=row_ok[:, None] & (cols < M)[None, :])
    tl.store(inv_rms_ptr + rows, inv_rms, mask=row_ok)


@triton.jit
def _mix_bwd_x_kernel(
    gs_ptr, coef_ptr, fn_ptr, x_ptr, gx_ptr, T, K, M, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr
):
    """gx [T, K] = gs [T, M] @ fn [M, K] + coef [T] * x."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    row_ok, k_ok = rows < T, ks < K
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    gs = tl.load(
        gs_ptr + rows64[:, None] * M + cols[None, :], mask=row_ok[:, None] & (cols < M)[None, :], other=0.0
    )
    w = tl.load(fn_ptr + cols[:, None] * K + ks[None, :], mask=(cols < M)[:, None] & k_ok[None, :], other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    mask = row_ok[:, None] & k_ok[None, :]
    offsets = rows64[:, None] * K + ks[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gx = tl.dot(gs, w, input_precision="ieee") + coef[:, None] * x
    tl.store(gx_ptr + offsets, gx.to(gx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_bwd_fn_kernel(
    gs_ptr, x_ptr, part_ptr, T, K, M, split_tokens, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr
):
    """part[s] [M, K] = gs[tokens of split s]^T @ x[tokens of split s]."""
    ks = tl.program_id(0) * BK + tl.arange(0, BK)
    split = tl.program_id(1)
    k_ok = ks < K
    cols = tl.arange(0, MP)
    acc = tl.full([MP, BK], 0.0, tl.float32)
    start = split * split_tokens
    for t0 in range(start, tl.minimum(start + split_tokens, T), BT):
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        gs_t = tl.load(
            gs_ptr + rows64[None, :] * M + cols[:, None],
            mask=(cols < M)[:, None] & row_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc = tl.dot(gs_t, x.to(tl.float32), acc, input_precision="ieee")
    out = part_ptr + split.to(tl.int64) * M * K + cols[:, None] * K + ks[None, :]
    tl.store(out, acc, mask=(cols < M)[:, None] & k_ok[None, :])


@triton.jit
def _collapse_fwd_kernel(
    s_ptr, pre_ptr, out_ptr, T, D, N: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    streams = tl.arange(0, NP)
    row_ok, d_ok, n_ok = rows < T, ds < D, streams < N
    rows64 = rows.to(tl.int64)
    pre = tl.load(
        pre_ptr + rows64[:, None] * N + streams[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0
    )
    offsets = rows64[:, None, None] * (N * D) + streams[None, :, None] * D + ds[None, None, :]
    mask = row_ok[:, None, None] & n_ok[None, :, None] & d_ok[None, None, :]
    s = tl.load(s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = _sum(pre[:, :, None] * s, 1)
    tl.store(out_ptr + rows64[:, None] * D + ds[None, :], out, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _collapse_bwd_kernel(
    g_ptr,
    s_ptr,
    pre_ptr,
    gs_ptr,
    gpre_ptr,
    T,
    D,
    N: tl.constexpr,
    BT: tl.constexpr,
    NP: tl.constexpr,
    BD: tl.constexpr,
):
    """gs [T, N, D] = pre[t, n] * g[t, :]; gpre [T, N] = sum_d g[t, d] * s[t, n, d]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    streams = tl.arange(0, NP)
    row_ok, n_ok = rows < T, streams < N
    rows64 = rows.to(tl.int64)
    pre = tl.load(
        pre_ptr + rows64[:, None] * N + streams[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0
    )
    acc = tl.full([BT, NP], 0.0, tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        d_ok = ds < D
        g = tl.load(
            g_ptr + rows64[:, None] * D + ds[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        g = g.to(tl.float32)
        offsets = rows64[:, None, None] * (N * D) + streams[None, :, None] * D + ds[None, None, :]
        mask = row_ok[:, None, None] & n_ok[None, :, None] & d_ok[None, None, :]
        s = tl.load(s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(gs_ptr + offsets, (pre[:, :, None] * g[:, None, :]).to(gs_ptr.dtype.element_ty), mask=mask)
        acc += _sum(s * g[:, None, :], 2)
    tl.store(gpre_ptr + rows64[:, None] * N + streams[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_fwd_kernel(
    post_ptr,
    comb_ptr,
    out_ptr,
    res_ptr,
    new_ptr,
    T,
    D,
    N: tl.constexpr,
    BT: tl.constexpr,
    NP: tl.constexpr,
    BD: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    streams = tl.arange(0, NP)
    row_ok, d_ok, m_ok = rows < T, ds < D, streams < N
    rows64 = rows.to(tl.int64)
    mask = row_ok[:, None, None] & m_ok[None, :, None] & d_ok[None, None, :]
    base = rows64[:, None, None] * (N * D) + streams[None, :, None] * D + ds[None, None, :]
    res = tl.load(res_ptr + base, mask=mask, other=0.0).to(tl.float32)  # [BT, m, BD]
    row_mask = row_ok[:, None] & d_ok[None, :]
    out = tl.load(out_ptr + rows64[:, None] * D + ds[None, :], mask=row_mask, other=0.0).to(tl.float32)
    for n in tl.static_range(N):
        post = tl.load(post_ptr + rows64 * N + n, mask=row_ok, other=0.0)
        comb = tl.load(
            comb_ptr + rows64[:, None] * (N * N) + streams[None, :] * N + n,
            mask=row_ok[:, None] & m_ok[None, :],
            other=0.0,
        )  # comb[t, :, n]
        new = post[:, None] * out + _sum(comb[:, :, None] * res, 1)
        dest = new_ptr + rows64[:, None] * (N * D) + n * D + ds[None, :]
        tl.store(dest, new.to(new_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _combine_bwd_kernel(
    g_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    res_ptr,
    gpost_ptr,
    gcomb_ptr,
    gout_ptr,
    gres_ptr,
    T,
    D,
    N: tl.constexpr,
    BT: tl.constexpr,
    NP: tl.constexpr,
    BD: tl.constexpr,
):
    """For g = d new [T, N, D]: gout = sum_n post[n] g[n]; gpost[n] = g[n] . out; gcomb[m, n] = res[m] . g[n];
    gres[m] = sum_n comb[m, n] g[n]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    idx = tl.arange(0, NP)
    row_ok, n_ok = rows < T, idx < N
    rows64 = rows.to(tl.int64)
    row_n = row_ok[:, None] & n_ok[None, :]
    post = tl.load(post_ptr + rows64[:, None] * N + idx[None, :], mask=row_n, other=0.0)
    pair = rows64[:, None, None] * (N * N) + idx[None, :, None] * N + idx[None, None, :]
    pair_mask = row_n[:, :, None] & n_ok[None, None, :]
    comb = tl.load(comb_ptr + pair, mask=pair_mask, other=0.0)  # [BT, m, n]
    acc_post = tl.full([BT, NP], 0.0, tl.float32)
    acc_comb = tl.full([BT, NP, NP], 0.0, tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        d_ok = ds < D
        offsets = rows64[:, None, None] * (N * D) + idx[None, :, None] * D + ds[None, None, :]
        mask = row_n[:, :, None] & d_ok[None, None, :]
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [BT, n, BD]
        res = tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [BT, m, BD]
        row_mask = row_ok[:, None] & d_ok[None, :]
        out_offsets = rows64[:, None] * D + ds[None, :]
        out = tl.load(out_ptr + out_offsets, mask=row_mask, other=0.0).to(tl.float32)
        gout = _sum(post[:, :, None] * g, 1)
        tl.store(gout_ptr + out_offsets, gout.to(gout_ptr.dtype.element_ty), mask=row_mask)
        acc_post += _sum(g * out[:, None, :], 2)
        acc_comb += _sum(res[:, :, None, :] * g[:, None, :, :], 3)
        gres = _sum(comb[:, :, :, None] * g[:, None, :, :], 2)
        tl.store(gres_ptr + offsets, gres.to(gres_ptr.dtype.element_ty), mask=mask)
    tl.store(gpost_ptr + rows64[:, None] * N + idx[None, :], acc_post, mask=row_n)
    tl.store(gcomb_ptr + pair, acc_comb, mask=pair_mask)


# ------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("genomelm::mhc_mix", mutates_args=())
def mhc_mix(x: Tensor, fn: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [T, K] (fp32/fp16/bf16), fn [M, K] fp32 -> (mixes [T, M] = x / rms(x) @ fn^T, inv_rms [T]), fp32."""
    tokens, width = x.shape
    m = fn.shape[0]
    mixes = x.new_empty(tokens, m, dtype=torch.float32)
    inv_rms = x.new_empty(tokens, dtype=torch.float32)
    grid = (triton.cdiv(tokens, MIX_TOKENS),)
    _mix_fwd_kernel[grid](x, fn, mixes, inv_rms, tokens, width, m, eps, MIX_TOKENS, MIX_WIDTH, _pow2(m, 16))
    return mixes, inv_rms


@mhc_mix.register_fake
def _(x: Tensor, fn: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape[0], fn.shape[0], dtype=torch.float32), x.new_empty(
        x.shape[0], dtype=torch.float32
    )


@torch.library.custom_op("genomelm::mhc_mix_backward", mutates_args=())
def mhc_mix_backward(
    grad: Tensor, mixes: Tensor, inv_rms: Tensor, x: Tensor, fn: Tensor
) -> tuple[Tensor, Tensor]:
    """d mixes [T, M] fp32 -> (d x [T, K] in x's dtype, d fn [M, K] fp32).

    With r = inv_rms and raw = mixes / r: d x = r (g @ fn) - (r^3 / K) (g . raw) x, d fn = (r g)^T @ x.
    """
    tokens, width = x.shape
    m = fn.shape[0]
    grad_scaled = (grad * inv_rms[:, None]).contiguous()
    coefficient = ((grad * mixes).sum(-1) * inv_rms.square() / -width).contiguous()
    grad_x = torch.empty_like(x)
    mp = _pow2(m, 16)
    grid = (triton.cdiv(tokens, MIX_TOKENS), triton.cdiv(width, MIX_WIDTH))
    _mix_bwd_x_kernel[grid](
        grad_scaled, coefficient, fn, x, grad_x, tokens, width, m, MIX_TOKENS, MIX_WIDTH, mp
    )
    splits = min(FN_SPLITS_MAX, triton.cdiv(tokens, 8 * MIX_TOKENS))
    split_tokens = triton.cdiv(triton.cdiv(tokens, splits), MIX_TOKENS) * MIX_TOKENS
    splits = triton.cdiv(tokens, split_tokens)
    partial = x.new_empty(splits, m, width, dtype=torch.float32)
    grid = (triton.cdiv(width, MIX_WIDTH), splits)
    _mix_bwd_fn_kernel[grid](
        grad_scaled, x, partial, tokens, width, m, split_tokens, MIX_TOKENS, MIX_WIDTH, mp
    )
    return grad_x, partial.sum(0)


@mhc_mix_backward.register_fake
def _(grad: Tensor, mixes: Tensor, inv_rms: Tensor, x: Tensor, fn: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), fn.new_empty(fn.shape, dtype=torch.float32)


def _mix_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, fn, _ = inputs
    mixes, inv_rms = output
    ctx.mark_non_differentiable(inv_rms)
    ctx.save_for_backward(mixes, inv_rms, x, fn)


def _mix_autograd(ctx: Any, grad: Tensor, _grad_inv_rms: Tensor | None) -> tuple[Tensor, Tensor, None]:
    mixes, inv_rms, x, fn = ctx.saved_tensors
    grad_x, grad_fn = mhc_mix_backward(grad.contiguous(), mixes, inv_rms, x, fn)
    return grad_x, grad_fn, None


mhc_mix.register_autograd(_mix_autograd, setup_context=_mix_setup)


@torch.library.custom_op("genomelm::mhc_collapse", mutates_args=())
def mhc_collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """streams [T, N, D], pre [T, N] fp32 -> block input [T, D] fp32 = sum_n pre[:, n] * streams[:, n]."""
    tokens, n, width = streams.shape
    out = streams.new_empty(tokens, width, dtype=torch.float32)
    grid = (triton.cdiv(tokens, STREAM_TOKENS), triton.cdiv(width, STREAM_WIDTH))
    _collapse_fwd_kernel[grid](streams, pre, out, tokens, width, n, STREAM_TOKENS, _pow2(n), STREAM_WIDTH)
    return out


@mhc_collapse.register_fake
def _(streams: Tensor, pre: Tensor) -> Tensor:
    return streams.new_empty(streams.shape[0], streams.shape[2], dtype=torch.float32)


@torch.library.custom_op("genomelm::mhc_collapse_backward", mutates_args=())
def mhc_collapse_backward(grad: Tensor, streams: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """d block input [T, D] -> (d streams [T, N, D] in streams' dtype, d pre [T, N] fp32)."""
    tokens, n, width = streams.shape
    grad_streams = torch.empty_like(streams)
    grad_pre = pre.new_empty(tokens, n, dtype=torch.float32)
    grid = (triton.cdiv(tokens, STREAM_TOKENS),)
    _collapse_bwd_kernel[grid](
        grad, streams, pre, grad_streams, grad_pre, tokens, width, n, STREAM_TOKENS, _pow2(n), STREAM_WIDTH
    )
    return grad_streams, grad_pre


@mhc_collapse_backward.register_fake
def _(grad: Tensor, streams: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(streams), pre.new_empty(pre.shape, dtype=torch.float32)


def _collapse_setup(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _collapse_autograd(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    streams, pre = ctx.saved_tensors
    return mhc_collapse_backward(grad.contiguous(), streams, pre)


mhc_collapse.register_autograd(_collapse_autograd, setup_context=_collapse_setup)


@torch.library.custom_op("genomelm::mhc_combine", mutates_args=())
def mhc_combine(post: Tensor, comb: Tensor, out: Tensor, residual: Tensor) -> Tensor:
    """post [T, N] fp32, comb [T, N, N] fp32, block output out [T, D], residual [T, N, D] -> new streams
    [T, N, D] in residual's dtype: post[:, n] * out + sum_m comb[:, m, n] * residual[:, m]."""
    tokens, n, width = residual.shape
    new = torch.empty_like(residual)
    grid = (triton.cdiv(tokens, STREAM_TOKENS), triton.cdiv(width, STREAM_WIDTH))
    _combine_fwd_kernel[grid](
        post, comb, out, residual, new, tokens, width, n, STREAM_TOKENS, _pow2(n), STREAM_WIDTH
    )
    return new


@mhc_combine.register_fake
def _(post: Tensor, comb: Tensor, out: Tensor, residual: Tensor) -> Tensor:
    return torch.empty_like(residual)


@torch.library.custom_op("genomelm::mhc_combine_backward", mutates_args=())
def mhc_combine_backward(
    grad: Tensor, post: Tensor, comb: Tensor, out: Tensor, residual: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """d new streams [T, N, D] -> (d post [T, N] fp32, d comb [T, N, N] fp32, d out like out, d residual like
    residual)."""
    tokens, n, width = residual.shape
    grad_post = torch.empty_like(post, dtype=torch.float32)
    grad_comb = torch.empty_like(comb, dtype=torch.float32)
    grad_out = torch.empty_like(out)
    grad_residual = torch.empty_like(residual)
    grid = (triton.cdiv(tokens, COMBINE_BWD_TOKENS),)
    _combine_bwd_kernel[grid](
        grad,
        post,
        comb,
        out,
        residual,
        grad_post,
        grad_comb,
        grad_out,
        grad_residual,
        tokens,
        width,
        n,
        COMBINE_BWD_TOKENS,
        _pow2(n),
        COMBINE_BWD_WIDTH,
    )
    return grad_post, grad_comb, grad_out, grad_residual


@mhc_combine_backward.register_fake
def _(grad: Tensor, post: Tensor, comb: Tensor, out: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
    return (
        torch.empty_like(post, dtype=torch.float32),
        torch.empty_like(comb, dtype=torch.float32),
        torch.empty_like(out),
        torch.empty_like(residual),
    )


def _combine_setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _combine_autograd(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return mhc_combine_backward(grad.contiguous(), *ctx.saved_tensors)


mhc_combine.register_autograd(_combine_autograd, setup_context=_combine_setup)


# ------------------------------------------------------------------------------ FLOPs and HBM bytes
@register_flop_formula(torch.ops.genomelm.mhc_mix)
def _mix_flop(x_shape, fn_shape, *args, **kwargs) -> int:
    (tokens, width), m = x_shape, fn_shape[0]
    return 2 * tokens * width * (m + 1)  # the projection plus the sum of squares


@register_flop_formula(torch.ops.genomelm.mhc_mix_backward)
def _mix_backward_flop(grad_shape, mixes_shape, inv_rms_shape, x_shape, fn_shape, *args, **kwargs) -> int:
    (tokens, width), m = x_shape, fn_shape[0]
    return 4 * tokens * width * m + 2 * tokens * width  # d x and d fn, plus the coefficient term


@register_flop_formula(torch.ops.genomelm.mhc_collapse)
def _collapse_flop(streams_shape, pre_shape, *args, **kwargs) -> int:
    tokens, n, width = streams_shape
    return 2 * tokens * n * width


@register_flop_formula(torch.ops.genomelm.mhc_collapse_backward)
def _collapse_backward_flop(grad_shape, streams_shape, pre_shape, *args, **kwargs) -> int:
    tokens, n, width = streams_shape
    return 3 * tokens * n * width


@register_flop_formula(torch.ops.genomelm.mhc_combine)
def _combine_flop(post_shape, comb_shape, block_shape, residual_shape, *args, **kwargs) -> int:
    tokens, n, width = residual_shape
    return 2 * tokens * n * width * (n + 1)


@register_flop_formula(torch.ops.genomelm.mhc_combine_backward)
def _combine_backward_flop(
    grad_shape, post_shape, comb_shape, block_shape, residual_shape, *args, **kwargs
) -> int:
    tokens, n, width = residual_shape
    return 4 * tokens * n * width * (n + 1)


def mix_traffic(tokens: int, hc_mult: int, hidden: int, itemsize: int) -> tuple[int, int]:
    """HBM bytes (forward, backward) of the mix for streams of `itemsize` bytes per value."""
    width, m = hc_mult * hidden, (2 + hc_mult) * hc_mult
    small = tokens * (m + 1) * 4  # mixes and inv_rms
    forward = tokens * width * itemsize + m * width * 4 + small
    partials = FN_SPLITS_MAX * m * width * 4
    backward = 3 * tokens * width * itemsize + 2 * small + 2 * m * width * 4 + 2 * partials
    return forward, backward


def collapse_traffic(tokens: int, hc_mult: int, hidden: int, itemsize: int) -> tuple[int, int]:
    """HBM bytes (forward, backward) of the collapse (fp32 block input and its gradient)."""
    streams, block = tokens * hc_mult * hidden * itemsize, tokens * hidden * 4
    return streams + block, 2 * streams + block


def combine_traffic(
    tokens: int, hc_mult: int, hidden: int, itemsize: int, out_itemsize: int
) -> tuple[int, int]:
    """HBM bytes (forward, backward) of the combine: streams of `itemsize`, block output of `out_itemsize`."""
    streams, block = tokens * hc_mult * hidden * itemsize, tokens * hidden * out_itemsize
    return 2 * streams + block, 3 * streams + 2 * block


# the roofline's per-op estimates (`genomelm.plan.roofline`): each takes its op's own arguments
def _streams_of_mix(x: Tensor, fn: Tensor) -> tuple[int, int, int]:
    """(tokens, N, D) of a mix over x [T, N*D] with fn [(2+N)*N, N*D]."""
    n = math.isqrt(fn.shape[0] + 1) - 1
    return x.shape[0], n, x.shape[1] // n


def mhc_mix_bytes(x: Tensor, fn: Tensor, eps: float) -> int:
    return mix_traffic(*_streams_of_mix(x, fn), x.element_size())[0]


def mhc_mix_backward_bytes(grad: Tensor, mixes: Tensor, inv_rms: Tensor, x: Tensor, fn: Tensor) -> int:
    return mix_traffic(*_streams_of_mix(x, fn), x.element_size())[1]


def mhc_collapse_bytes(streams: Tensor, pre: Tensor) -> int:
    return collapse_traffic(*streams.shape, streams.element_size())[0]


def mhc_collapse_backward_bytes(grad: Tensor, streams: Tensor, pre: Tensor) -> int:
    return collapse_traffic(*streams.shape, streams.element_size())[1]


def mhc_combine_bytes(post: Tensor, comb: Tensor, out: Tensor, residual: Tensor) -> int:
    return combine_traffic(*residual.shape, residual.element_size(), out.element_size())[0]


def mhc_combine_backward_bytes(
    grad: Tensor, post: Tensor, comb: Tensor, out: Tensor, residual: Tensor
) -> int:
    return combine_traffic(*residual.shape, residual.element_size(), out.element_size())[1]


# ------------------------------------------------------------------------------------- entry points
def mix(streams: Tensor, fn: Tensor, eps: float) -> Tensor:
    """streams [B, S, N, D], fn [M, N*D] fp32 -> mixes [B*S, M] fp32."""
    check_streams(streams)
    return mhc_mix(streams.flatten(2).flatten(0, 1).contiguous(), fn.contiguous(), eps)[0]


def collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """streams [B, S, N, D], pre [B*S, N] fp32 -> block input [B, S, D] fp32."""
    check_streams(streams)
    batch, seq_len, n, width = streams.shape
    flat = streams.reshape(batch * seq_len, n, width).contiguous()
    return mhc_collapse(flat, pre.contiguous()).view(batch, seq_len, width)


def combine(post: Tensor, comb: Tensor, block_output: Tensor, residual: Tensor) -> Tensor:
    """post [B, S, N], comb [B, S, N, N] fp32, block output [B, S, D], residual [B, S, N, D] -> new streams
    [B, S, N, D] in residual's dtype (see `hc_combine`)."""
    check_streams(residual)
    batch, seq_len, n, width = residual.shape
    tokens = batch * seq_len
    new = mhc_combine(
        post.reshape(tokens, n).float().contiguous(),
        comb.reshape(tokens, n, n).float().contiguous(),
        block_output.reshape(tokens, width).contiguous(),
        residual.reshape(tokens, n, width).contiguous(),
    )
    return new.view(batch, seq_len, n, width)
