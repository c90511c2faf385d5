"""The pool mass of `train_indexer`'s KL term as a Triton kernel (`dsa_backend="triton"`), the fused form of
the torch sparse path's: a pass after `genomelm.model.dsa_triton`'s forward with its final log-sum-exp,
summing the attention probability over the heads and over each selected pool's kpool slots -> [B, n, K] fp32
(no gradient). One program per query walks its pool slots tile by tile and, per tile, every block of heads.
A torch custom op (`genomelm::sparse_mla_pool_mass`) with a fake, a FLOP formula and a byte estimate
(`sparse_mla_pool_mass_bytes`). A kpool that is not a power of two dividing the slot tile is refused."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from genomelm.model.dsa_triton_common import (
    FORWARD_TILES,
    LOG2E,
    check_pool_mass,
    contiguous_rows,
    dot_precision,
    gathered_bytes,
    head_block,
    pair_count,
    slot_tokens,
    tiles,
)

_LOG2E = tl.constexpr(LOG2E)  # log2(e), readable inside the kernel


@triton.jit
def _pool_mass_kernel(
    q_ptr,
    latent_ptr,
    pools_ptr,
    positions_ptr,
    lse_ptr,
    mass_ptr,
    n_queries,
    H,
    L,
    K,
    qk_scale,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_lb,
    stride_ls,
    stride_pb,
    stride_pn,
    KPOOL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DOT: tl.constexpr,
):
    """One query's probability mass per selected pool, summed over all heads: mass [B, n, K] fp32."""
    row = tl.program_id(0)
    b = (row // n_queries).to(tl.int64)
    i = (row % n_queries).to(tl.int64)
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    position = tl.load(positions_ptr + i)
    pools_row = pools_ptr + b * stride_pb + i * stride_pn
    rows = latent_ptr + b * stride_lb
    for w0 in range(0, K * KPOOL, BLOCK_W):
        # the tail slots carry no pool: TAIL off
        token, valid = slot_tokens(pools_row, w0 + tl.arange(0, BLOCK_W), position, K, KPOOL, False)
        kv = tl.load(
            rows + token[:, None] * stride_ls + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        )
        mass = tl.zeros([BLOCK_W], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            head_ok = heads < H
            q_offsets = (
                b * stride_qb + i * stride_qn + heads[:, None].to(tl.int64) * stride_qh + cols[None, :]
            )
            q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None] & col_ok[None, :], other=0.0)
            lse2 = tl.load(lse_ptr + row.to(tl.int64) * H + heads, mask=head_ok, other=0.0) * _LOG2E
            s = tl.dot(q, tl.trans(kv), input_precision=DOT) * qk_scale
            p = tl.where(valid[None, :] & head_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
            mass += tl.sum(p, 0)
        per_pool = tl.sum(tl.reshape(mass, [BLOCK_W // KPOOL, KPOOL]), 1)
        k = w0 // KPOOL + tl.arange(0, BLOCK_W // KPOOL)
        tl.store(mass_ptr + row.to(tl.int64) * K + k, per_pool, mask=k < K)


@torch.library.custom_op("genomelm::sparse_mla_pool_mass", mutates_args=())
def sparse_mla_pool_mass(
    q_lat: Tensor, latent: Tensor, lse: Tensor, pools: Tensor, positions: Tensor, kpool: int, scaling: float
) -> Tensor:
    """Head-summed attention probability per selected pool [B, n, K] fp32 (no gradient), from the
    forward's lse [B, n, H]; the tail slots belong to no pool."""
    batch, queries, heads, width = q_lat.shape
    pools_per_query = pools.shape[-1]
    check_pool_mass(kpool)
    tile = tiles()
    q_lat, latent, pools = contiguous_rows(q_lat), contiguous_rows(latent), pools.contiguous().to(torch.int32)
    positions = positions.contiguous().to(device=q_lat.device, dtype=torch.int64)
    mass = torch.empty(batch, queries, pools_per_query, dtype=torch.float32, device=q_lat.device)
    _pool_mass_kernel[(batch * queries,)](
        q_lat,
        latent,
        pools,
        positions,
        lse.contiguous(),
        mass,
        queries,
        heads,
        width,
        pools_per_query,
        scaling * LOG2E,
        *q_lat.stride()[:3],
        *latent.stride()[:2],
        *pools.stride()[:2],
        KPOOL=kpool,
        BLOCK_H=head_block(heads, tile),
        BLOCK_W=tile.block_w,
        BLOCK_L=max(16, triton.next_power_of_2(width)),
        DOT=dot_precision(q_lat.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return mass


@sparse_mla_pool_mass.register_fake
def _(q_lat, latent, lse, pools, positions, kpool, scaling):
    return q_lat.new_empty(*pools.shape, dtype=torch.float32)


@register_flop_formula(torch.ops.genomelm.sparse_mla_pool_mass)
def _pool_mass_flops(
    q_shape, latent_shape, lse_shape, pools_shape, positions_shape, kpool, *args, **kwargs
) -> int:
    """The scores of the pool slots again: 2 x B n H (K kpool) L."""
    return 2 * pair_count(q_shape, pools_shape, kpool, False)


def sparse_mla_pool_mass_bytes(
    q_lat: Tensor, latent: Tensor, lse: Tensor, pools: Tensor, positions: Tensor, kpool: int, *_: object
) -> int:
    """HBM bytes of `sparse_mla_pool_mass`: the pool slots' latent rows once per query, q_lat once per slot
    tile (the head loop runs inside the tile loop), lse, the pools and the mass."""
    pool_slots = pools.shape[-1] * kpool
    q_reads = math.ceil(pool_slots / FORWARD_TILES.block_w) * q_lat.numel() * q_lat.element_size()
    small = lse.numel() * 4 + pools.numel() * (pools.element_size() + 4)
    return gathered_bytes(q_lat, pool_slots) + q_reads + small
