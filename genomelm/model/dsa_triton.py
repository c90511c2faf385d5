"""DSA's sparse attention core as Triton kernels (`dsa_backend="triton"`): the fused form of `dsa_sparse`.

Same maths as `dsa_sparse.sparse_latent_attention` (absorbed-latent form: scores q_lat . latent[slot] over the
kv_lora_rank-wide latent L, output the probability-weighted sum of those latents), in three kernels and
the deterministic mode's reduction:
- forward: one program per (query, block of `block_h` heads); the heads are the M dimension of both dots. It
  reads the query's selected pools [K] int32 and global position and computes its W = K * kpool + kpool - 1
  slot tokens in the kernel (pools expanded, then the tail pool), tile by tile of `block_w` slots (the last
  tile masked), loads those latent rows, and runs an online softmax in fp32 (exp2, the running max and sum
  per head). It writes out_lat and the log-sum-exp [B, n, H] fp32 of the scaled scores.
- backward: the same walk; recomputes p from the saved log-sum-exp, then d q_lat (fp32 in registers) and d
  latent per tile, d G = p^T g + scale * dS^T q_lat (G: the tile's latent rows, used as both key and value),
  added by fp32 atomics into a [B*S, L] fp32 buffer (default), or, `deterministic`, written per (query, head
  block, slot) and reduced per latent row in a fixed order (a second kernel over a stable sort of the slot
  tokens: for tests and bit-reproducible runs; its buffer is [B*n*head_blocks, W, L] fp32, far too big at
  full size).
- pool mass (`train_indexer`'s KL term): `genomelm.model.dsa_triton_mass`, a pass after the forward with
  the final log-sum-exp. Shared tiles, checks and the slot rule: `genomelm.model.dsa_triton_common`.
The dots take the inputs' dtype with fp32 accumulation (fp32 inputs: full fp32, not TF32). A query with no
slot at all, which the indexer never yields (every query sees its tail or a complete pool), gets out_lat 0
and lse -inf where the torch path would average the rows its empty slots clamp to.

Memory per layer call (n queries, H heads, W slots, L latent; the torch path runs `attention_query_block`
= b queries at a time): the torch path holds per block a gathered [b, W, L] latent and [b, H, W] scores and
probabilities, and in backward also the gathered rows' gradient in bf16 and fp32 and fp32 probability
gradients: at b = 128, W = 2,051, L = 512, H = 64 in bf16, ~256 MiB gathered + ~130 MiB scores in forward,
~1.3 GiB per block in backward. These kernels keep every tile in registers and shared memory: beyond their
outputs (out_lat, and lse [n, H] fp32: 16 MiB at 64k queries) only the backward's [B*S, L] fp32 d latent
buffer, which the torch path holds too (128 MiB at 64k tokens). The slot tokens are computed in the kernels
from the selection's pools [n, K] int32 and the query positions [n]: no [n, W] index tensor.

Every kernel is a torch custom op (`genomelm::sparse_mla_fwd`, `genomelm::sparse_mla_bwd`,
`genomelm::sparse_mla_pool_mass`) with a fake implementation (shapes and dtypes; the backward's fake also
allocates its fp32 d latent buffer, so a fake-tensor memory trace sees it), autograd, a FLOP formula for
`FlopCounterMode` and a `*_bytes` estimate of its HBM traffic.

Shapes the kernels refuse (ValueError naming the shape): a latent wider than `MAX_LATENT` (a program holds
[heads, L] fp32 accumulators), dtypes other than fp16 / bf16 / fp32 or q_lat and latent in different
dtypes, and, for the pool mass only, a kpool that is not a power of two dividing the slot tile. Under the
interpreter (`TRITON_INTERPRET=1`, CPU tensors) the kernels run with `INTERPRETER_TILES`; bf16 is wrong there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from genomelm.model.dsa_triton_common import (
    BACKWARD_TILES,
    LOG2E,
    check_deterministic,
    check_inputs,
    check_pool_mass,
    contiguous_rows,
    dot_precision,
    gathered_bytes,
    head_block,
    pair_count,
    slot_count,
    slot_tokens,
    tiles,
)
from genomelm.model.dsa_triton_mass import sparse_mla_pool_mass
from genomelm.model.indexer import Selection

_LOG2E = tl.constexpr(LOG2E)  # log2(e), readable inside the kernels


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _fwd_kernel(
    q_ptr,
    latent_ptr,
    pools_ptr,
    positions_ptr,
    out_ptr,
    lse_ptr,
    n_queries,
    H,
    L,
    K,
    W,
    qk_scale,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_pb,
    stride_pn,
    KPOOL: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DOT: tl.constexpr,
):
    """One query's heads h0..h0+BLOCK_H-1: out = softmax(scale q G^T) G over its slots G, and the lse.
    qk_scale = scale * log2(e) (scores in base 2); lse is [B, n, H] contiguous."""
    program = tl.program_id(0)  # the head blocks of one query run side by side: its rows stay in L2
    row = program // tl.cdiv(H, BLOCK_H)
    b = (row // n_queries).to(tl.int64)
    i = (row % n_queries).to(tl.int64)
    heads = (program % tl.cdiv(H, BLOCK_H)) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_L)
    head_ok = heads < H
    col_ok = cols < L
    q_offsets = b * stride_qb + i * stride_qn + heads[:, None].to(tl.int64) * stride_qh + cols[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None] & col_ok[None, :], other=0.0)
    position = tl.load(positions_ptr + i)
    pools_row = pools_ptr + b * stride_pb + i * stride_pn
    rows = latent_ptr + b * stride_lb
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        token, valid = slot_tokens(pools_row, w0 + tl.arange(0, BLOCK_W), position, K, KPOOL, TAIL)
        kv = tl.load(
            rows + token[:, None] * stride_ls + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kv), input_precision=DOT) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with no slot yet: p = 0, not NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT)
        m = m_new
    some = total > 0.0
    safe_total = tl.where(some, total, 1.0)
    out = acc / safe_total[:, None]
    out_offsets = b * stride_ob + i * stride_on + heads[:, None].to(tl.int64) * stride_oh + cols[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & col_ok[None, :])
    lse = tl.where(some, (m + tl.log2(safe_total)) / _LOG2E, float("-inf"))
    tl.store(lse_ptr + row.to(tl.int64) * H + heads, lse, mask=head_ok)


@triton.jit
def _bwd_kernel(
    q_ptr,
    latent_ptr,
    pools_ptr,
    positions_ptr,
    out_ptr,
    grad_out_ptr,
    lse_ptr,
    grad_q_ptr,
    grad_latent_ptr,
    n_queries,
    seq_len,
    H,
    L,
    K,
    W,
    W_PADDED,
    scaling,
    qk_scale,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_gb,
    stride_gn,
    stride_gh,
    stride_dqb,
    stride_dqn,
    stride_dqh,
    stride_lb,
    stride_ls,
    stride_pb,
    stride_pn,
    KPOOL: tl.constexpr,
    TAIL: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DOT: tl.constexpr,
):
    """Gradients of one query's heads h0..h0+BLOCK_H-1 (q, out, grad_out, grad_q: [B, n, H, L], each with its
    own strides, the last 1).

    With D = rowsum(g * out) and p = exp(scale q G^T - lse): dS = p (g G^T - D); d q = scale dS G; d G = p^T
    g + scale dS^T q, added atomically into grad_latent [B*S, L] fp32, or, DETERMINISTIC, stored to its
    own rows of grad_latent [B*n*head_blocks, W_PADDED, L] fp32 for a fixed-order reduction.
    """
    program = tl.program_id(0)  # as in the forward: (query, head block), head blocks side by side
    row = program // tl.cdiv(H, BLOCK_H)
    b = (row // n_queries).to(tl.int64)
    i = (row % n_queries).to(tl.int64)
    heads = (program % tl.cdiv(H, BLOCK_H)) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_L)
    head_ok = heads < H
    col_ok = cols < L
    hl_ok = head_ok[:, None] & col_ok[None, :]
    head_rows = heads[:, None].to(tl.int64)
    q = tl.load(
        q_ptr + b * stride_qb + i * stride_qn + head_rows * stride_qh + cols[None, :], mask=hl_ok, other=0.0
    )
    g_offsets = b * stride_gb + i * stride_gn + head_rows * stride_gh + cols[None, :]
    g = tl.load(grad_out_ptr + g_offsets, mask=hl_ok, other=0.0)
    o_offsets = b * stride_ob + i * stride_on + head_rows * stride_oh + cols[None, :]
    o = tl.load(out_ptr + o_offsets, mask=hl_ok, other=0.0)
    delta = tl.sum(g.to(tl.float32) * o.to(tl.float32), 1)
    lse2 = tl.load(lse_ptr + row.to(tl.int64) * H + heads, mask=head_ok, other=0.0) * _LOG2E
    position = tl.load(positions_ptr + i)
    pools_row = pools_ptr + b * stride_pb + i * stride_pn
    rows = latent_ptr + b * stride_lb
    grad_q = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        token, valid = slot_tokens(pools_row, w, position, K, KPOOL, TAIL)
        kv = tl.load(
            rows + token[:, None] * stride_ls + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kv), input_precision=DOT) * qk_scale
        p = tl.where(valid[None, :] & head_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        grad_p = tl.dot(g, tl.trans(kv), input_precision=DOT)
        grad_s = p * (grad_p - delta[:, None])
        grad_q += tl.dot(grad_s.to(kv.dtype), kv, input_precision=DOT)
        grad_kv = tl.dot(tl.trans(p.to(kv.dtype)), g, input_precision=DOT)
        grad_kv += tl.dot(tl.trans((grad_s * scaling).to(kv.dtype)), q, input_precision=DOT)
        if DETERMINISTIC:
            slot_rows = program.to(tl.int64) * W_PADDED + w
            tl.store(grad_latent_ptr + slot_rows[:, None] * L + cols[None, :], grad_kv, mask=col_ok[None, :])
        else:
            target = grad_latent_ptr + (b * seq_len + token)[:, None] * L + cols[None, :]
            tl.atomic_add(target, grad_kv, mask=valid[:, None] & col_ok[None, :])
    grad_q_offsets = b * stride_dqb + i * stride_dqn + head_rows * stride_dqh + cols[None, :]
    tl.store(grad_q_ptr + grad_q_offsets, (grad_q * scaling).to(grad_q_ptr.dtype.element_ty), mask=hl_ok)


@triton.jit
def _reduce_rows_kernel(parts_ptr, order_ptr, offsets_ptr, out_ptr, L, BLOCK_L: tl.constexpr):
    """out[r] = sum of parts[order[j]] for j in offsets[r]..offsets[r+1]-1, in that order (rows of L)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    start = tl.load(offsets_ptr + r)
    end = tl.load(offsets_ptr + r + 1)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for j in range(start, end):
        source = tl.load(order_ptr + j)
        acc += tl.load(parts_ptr + source * L + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + r * L + cols, acc, mask=col_ok)


# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("genomelm::sparse_mla_fwd", mutates_args=())
def sparse_mla_fwd(
    q_lat: Tensor,
    latent: Tensor,
    pools: Tensor,
    positions: Tensor,
    kpool: int,
    select_tail: bool,
    scaling: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Sparse MLA forward: q_lat [B, n, H, L], latent [B, S, L] (one dtype), pools [B, n, K] int32 (-1:
    empty), positions [n] int64 (the queries' global positions) -> (out_lat [B, n, H, L] in q_lat's dtype,
    lse [B, n, H] fp32, natural log). `deterministic` only chooses how the backward reduces d latent."""
    check_inputs(q_lat, latent, pools, positions)
    batch, queries, heads, width = q_lat.shape
    q_lat, latent, pools = contiguous_rows(q_lat), contiguous_rows(latent), pools.contiguous().to(torch.int32)
    positions = positions.contiguous().to(device=q_lat.device, dtype=torch.int64)
    tile = tiles()
    block_h = head_block(heads, tile)
    # q_lat's layout (the absorbed queries' einsum leaves them head-major): W_uv's einsum after the core then
    # reads the output without a permuted copy, as it reads the torch path's
    out = torch.empty_like(q_lat)
    lse = torch.empty(batch, queries, heads, dtype=torch.float32, device=q_lat.device)
    pools_per_query = pools.shape[-1]
    _fwd_kernel[(batch * queries * triton.cdiv(heads, block_h),)](
        q_lat,
        latent,
        pools,
        positions,
        out,
        lse,
        queries,
        heads,
        width,
        pools_per_query,
        slot_count(pools_per_query, kpool, select_tail),
        scaling * LOG2E,
        *q_lat.stride()[:3],
        *out.stride()[:3],
        *latent.stride()[:2],
        *pools.stride()[:2],
        KPOOL=kpool,
        TAIL=select_tail and kpool > 1,
        BLOCK_H=block_h,
        BLOCK_W=tile.block_w,
        BLOCK_L=max(16, triton.next_power_of_2(width)),
        DOT=dot_precision(q_lat.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out, lse


@sparse_mla_fwd.register_fake
def _(q_lat, latent, pools, positions, kpool, select_tail, scaling, deterministic):
    batch, queries, heads, _ = q_lat.shape
    return torch.empty_like(q_lat), q_lat.new_empty(batch, queries, heads, dtype=torch.float32)


@torch.library.custom_op("genomelm::sparse_mla_bwd", mutates_args=())
def sparse_mla_bwd(
    grad_out: Tensor,
    q_lat: Tensor,
    latent: Tensor,
    out: Tensor,
    lse: Tensor,
    pools: Tensor,
    positions: Tensor,
    kpool: int,
    select_tail: bool,
    scaling: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Sparse MLA backward: (grad_q_lat like q_lat, grad_latent [B, S, L] fp32: the accumulator itself, cast
    to latent's dtype by the caller, so a memory trace sees it as the op's output).

    Default: d latent by fp32 atomics into a [B*S, L] buffer (order-dependent rounding, so not
    bit-reproducible). `deterministic`: per-slot parts [B*n*head_blocks, W, L] fp32, then a fixed-order sum
    per latent row (test sizes only: 8 GiB at 1k queries of full width)."""
    batch, queries, heads, width = q_lat.shape
    seq_len = latent.shape[1]
    grad_out, q_lat, latent, out = (
        contiguous_rows(grad_out),
        contiguous_rows(q_lat),
        contiguous_rows(latent),
        contiguous_rows(out),
    )
    lse, pools = lse.contiguous(), pools.contiguous().to(torch.int32)
    positions = positions.contiguous().to(device=q_lat.device, dtype=torch.int64)
    tile = tiles(backward=True)
    block_h = head_block(heads, tile)
    head_blocks = triton.cdiv(heads, block_h)
    pools_per_query = pools.shape[-1]
    slots = slot_count(pools_per_query, kpool, select_tail)
    padded = triton.cdiv(slots, tile.block_w) * tile.block_w
    block_l = max(16, triton.next_power_of_2(width))
    grad_q = torch.empty_like(q_lat)  # q_lat's layout (a dense permutation stays one)
    if deterministic:
        buffer = torch.empty(
            batch * queries * head_blocks * padded, width, dtype=torch.float32, device=q_lat.device
        )
    else:
        buffer = torch.zeros(batch * seq_len, width, dtype=torch.float32, device=q_lat.device)
    _bwd_kernel[(batch * queries * head_blocks,)](
        q_lat,
        latent,
        pools,
        positions,
        out,
        grad_out,
        lse,
        grad_q,
        buffer,
        queries,
        seq_len,
        heads,
        width,
        pools_per_query,
        slots,
        padded,
        scaling,
        scaling * LOG2E,
        *q_lat.stride()[:3],
        *out.stride()[:3],
        *grad_out.stride()[:3],
        *grad_q.stride()[:3],
        *latent.stride()[:2],
        *pools.stride()[:2],
        KPOOL=kpool,
        TAIL=select_tail and kpool > 1,
        DETERMINISTIC=deterministic,
        BLOCK_H=block_h,
        BLOCK_W=tile.block_w,
        BLOCK_L=block_l,
        DOT=dot_precision(q_lat.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if deterministic:
        buffer = _reduce_in_order(buffer, pools, positions, kpool, select_tail, seq_len, head_blocks, padded)
    return grad_q, buffer.view(batch, seq_len, width)


@sparse_mla_bwd.register_fake
def _(grad_out, q_lat, latent, out, lse, pools, positions, kpool, select_tail, scaling, deterministic):
    return torch.empty_like(q_lat), latent.new_empty(latent.shape, dtype=torch.float32)


def _reduce_in_order(
    parts: Tensor,
    pools: Tensor,
    positions: Tensor,
    kpool: int,
    select_tail: bool,
    seq_len: int,
    head_blocks: int,
    padded: int,
) -> Tensor:
    """Sum the per-slot parts [B*n*head_blocks*padded, L] into latent rows [B*S, L] fp32, each row's parts
    in the order of their place in `parts` (a stable sort by target row), so the result is reproducible."""
    batch, queries, _ = pools.shape
    # the slot rule as the torch path applies it: [B, n, W] int64, -1 for empty slots
    tokens = Selection(pools, kpool, select_tail, positions).token_indices()
    tokens = torch.nn.functional.pad(tokens, (0, padded - tokens.shape[-1]), value=-1)
    rows = tokens + (torch.arange(batch, device=tokens.device) * seq_len)[:, None, None]
    rows = rows.masked_fill(tokens < 0, batch * seq_len)  # empty slots sort last and are never read
    rows = rows[:, :, None, :].expand(batch, queries, head_blocks, padded).flatten()
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=batch * seq_len + 1)[: batch * seq_len]
    offsets = torch.zeros(batch * seq_len + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    out = torch.empty(batch * seq_len, parts.shape[1], dtype=torch.float32, device=parts.device)
    width = parts.shape[1]
    _reduce_rows_kernel[(batch * seq_len,)](
        parts, order, offsets, out, width, max(16, triton.next_power_of_2(width))
    )
    return out


def _setup_context(ctx, inputs, output) -> None:
    q_lat, latent, pools, positions, kpool, select_tail, scaling, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q_lat, latent, out, lse, pools, positions)
    ctx.kpool, ctx.select_tail, ctx.scaling, ctx.deterministic = kpool, select_tail, scaling, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor | None):
    q_lat, latent, out, lse, pools, positions = ctx.saved_tensors
    grad_q, grad_latent = sparse_mla_bwd(
        grad_out,
        q_lat,
        latent,
        out,
        lse,
        pools,
        positions,
        ctx.kpool,
        ctx.select_tail,
        ctx.scaling,
        ctx.deterministic,
    )
    return grad_q, grad_latent.to(latent.dtype), None, None, None, None, None, None


sparse_mla_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------- FLOPs, bytes
@register_flop_formula(torch.ops.genomelm.sparse_mla_fwd)
def _fwd_flops(
    q_shape, latent_shape, pools_shape, positions_shape, kpool, select_tail, *args, **kwargs
) -> int:
    """Two dots (scores, output): 4 x B n H W L."""
    return 4 * pair_count(q_shape, pools_shape, kpool, select_tail)


@register_flop_formula(torch.ops.genomelm.sparse_mla_bwd)
def _bwd_flops(
    grad_shape,
    q_shape,
    latent_shape,
    out_shape_,
    lse_shape,
    pools_shape,
    positions_shape,
    kpool,
    select_tail,
    *args,
    **kwargs,
) -> int:
    """Five dots (scores recomputed, d p, d q, and d latent's two): 10 x B n H W L."""
    return 10 * pair_count(q_shape, pools_shape, kpool, select_tail)


def sparse_mla_fwd_bytes(
    q_lat: Tensor, latent: Tensor, pools: Tensor, positions: Tensor, kpool: int, select_tail: bool, *_: object
) -> int:
    """HBM bytes of `sparse_mla_fwd` (called with its arguments; an estimate with no cache reuse across
    queries): q_lat read and out_lat written, lse, the pools, and each query's W latent rows."""
    batch, queries, heads, _ = q_lat.shape
    slots = slot_count(pools.shape[-1], kpool, select_tail)
    small = batch * queries * heads * 4 + pools.numel() * pools.element_size() + positions.numel() * 8
    return 2 * q_lat.numel() * q_lat.element_size() + small + gathered_bytes(q_lat, slots)


def sparse_mla_bwd_bytes(
    grad_out: Tensor,
    q_lat: Tensor,
    latent: Tensor,
    out: Tensor,
    lse: Tensor,
    pools: Tensor,
    positions: Tensor,
    kpool: int,
    select_tail: bool,
    *_: object,
) -> int:
    """HBM bytes of the (atomic) `sparse_mla_bwd`: q_lat, out, grad_out read and grad_q written, lse and the
    pools, each query's W latent rows, an fp32 read-modify-write of the d latent buffer per slot row and
    head block (the atomics, scattered over the window: counted as HBM traffic), and that [B*S, L] fp32
    buffer zeroed, read and cast to the latent's dtype."""
    batch, queries, heads, width = q_lat.shape
    slots = slot_count(pools.shape[-1], kpool, select_tail)
    block_h = BACKWARD_TILES.block_h
    per_query = (
        4 * q_lat.numel() * q_lat.element_size() + lse.numel() * 4 + pools.numel() * pools.element_size()
    )
    atomics = 2 * batch * queries * math.ceil(heads / block_h) * slots * width * 4
    buffer = latent.shape[0] * latent.shape[1] * width * (4 + 4 + latent.element_size())
    return per_query + gathered_bytes(q_lat, slots) + atomics + buffer


# ---------------------------------------------------------------------------------------------- entry point
def sparse_mla(
    q_lat: Tensor,
    latent: Tensor,
    pools: Tensor,
    positions: Tensor,
    kpool: int,
    select_tail: bool,
    scaling: float,
    want_pool_mass: bool,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The kernels' form of `dsa_sparse.sparse_latent_attention`: (out_lat [B, n, H, L], and when
    `want_pool_mass` the head-summed mass per selected pool [B, n, K] fp32, no gradient; else None).
    Gradients flow to q_lat and latent."""
    check_inputs(q_lat, latent, pools, positions)
    if deterministic:
        check_deterministic(q_lat, pools.shape[-1], kpool, select_tail)
    if want_pool_mass:
        check_pool_mass(kpool)
    out, lse = sparse_mla_fwd(q_lat, latent, pools, positions, kpool, select_tail, scaling, deterministic)
    if not want_pool_mass:
        return out, None
    with torch.no_grad():
        mass = sparse_mla_pool_mass(q_lat.detach(), latent.detach(), lse, pools, positions, kpool, scaling)
    return out, mass
