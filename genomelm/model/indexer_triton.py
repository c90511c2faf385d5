"""Triton kernel of the lightning indexer's scores: q.k on tensor cores with the scale, ReLU, head weighting
and causal + complete-pool mask fused, so the [queries, heads, pools] scores never reach memory.

One program scores a tile of BLOCK_M queries against a tile of BLOCK_N pools: it loads the pool keys once,
then for each head loads the queries' [BLOCK_M, head_dim] slice, runs `tl.dot` (operands in the compute
dtype: bf16 on the GPU, fp8 e4m3 when asked; fp32 accumulation), scales, applies the ReLU and adds the
head's weight times it to a [BLOCK_M, BLOCK_N] fp32 accumulator. A pool tile that no query of the tile can
see skips the head loop. The output is the [B, M, P] fp32 index scores, invisible pools
`finfo(float32).min`, as the torch path's `Indexer._block_scores`; `Indexer.select` takes their top-k with
torch.topk on rows of the torch path's lengths (`TOPK_SORT_RATIO`), so ties (exact zeros are common) are
broken as the torch path breaks them: on the CPU the selection equals the torch path's and transformers'.

Transient: the output, [B, block, P] fp32 per block of queries, H times smaller than the torch path's
[B, block, H, P] fp32 at the same block, plus the compute-dtype q of the block [B, block, H, D].

Imported only when the Triton backend is chosen: the CPU-only path never imports triton.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from genomelm.model.backends import triton_interpreted

# tl.dot needs tiles of at least 16 along every dimension; the head dim is padded (with zeros) up to this
MIN_DOT = 16
# head dims above this would not fit the [BLOCK_N, head_dim] key tile in registers / shared memory
MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on the grid's second and third dimensions
OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def tile_config() -> tuple[int, int, int]:
    """(BLOCK_M queries, BLOCK_N pools, num_warps): one fixed config (autotuning needs a GPU driver); small
    tiles under the interpreter, where each program is a Python call."""
    if triton_interpreted():
        return 16, 32, 1
    return 64, 128, 4


@triton.jit
def _index_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    ks_ptr,
    out_ptr,
    n_queries,
    n_pools,
    n_heads,
    head_dim,
    start,
    scale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_wb,
    stride_wm,
    stride_ksb,
    stride_ob,
    stride_om,
    KPOOL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KEY_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_n = tl.program_id(0)
    tile_m = tl.program_id(1)
    b = tl.program_id(2)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_queries
    col_ok = cols < n_pools
    position = start + rows
    visible = ((cols * KPOOL + KPOOL - 1)[None, :] <= position[:, None]) & col_ok[None, :]

    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # (not tl.zeros: a jit helper, see the tests)
    last_position = start + tl.minimum(tile_m * BLOCK_M + BLOCK_M, n_queries) - 1
    if tile_n * BLOCK_N * KPOOL + KPOOL - 1 <= last_position:
        keys = tl.load(
            k_ptr + b * stride_kb + cols[:, None] * stride_kp + dims[None, :],
            mask=col_ok[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        )
        keys_t = tl.trans(keys)
        if HAS_KEY_SCALE:
            col_scale = tl.load(ks_ptr + b * stride_ksb + cols, mask=col_ok, other=0.0) * scale
        q_rows = q_ptr + b * stride_qb + rows[:, None] * stride_qm + dims[None, :]
        q_mask = row_ok[:, None] & (dims[None, :] < head_dim)
        w_rows = w_ptr + b * stride_wb + rows * stride_wm
        for h in range(n_heads):
            q = tl.load(q_rows + h * stride_qh, mask=q_mask, other=0.0)
            s = tl.dot(q, keys_t, input_precision=DOT_PRECISION)
            if HAS_KEY_SCALE:
                s = s * col_scale[None, :]
            else:
                s = s * scale
            weight = tl.load(w_rows + h, mask=row_ok, other=0.0)
            acc += tl.maximum(s, 0.0) * weight[:, None]

    acc = tl.where(visible, acc, -3.4028234663852886e38)
    out = out_ptr + b * stride_ob + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def check_shapes(q: Tensor, keys: Tensor, weights: Tensor, key_scale: Tensor | None) -> None:
    """Raise ValueError naming the shape or layout the kernel cannot take."""
    if q.dim() != 4 or keys.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"indexer kernel: q [B, M, H, D], keys [B, P, D], weights [B, M, H] expected, got q "
            f"{tuple(q.shape)}, keys {tuple(keys.shape)}, weights {tuple(weights.shape)}"
        )
    batch, queries, heads, head_dim = q.shape
    if keys.shape[0] != batch or keys.shape[2] != head_dim or tuple(weights.shape) != (batch, queries, heads):
        raise ValueError(
            f"indexer kernel: q {tuple(q.shape)}, keys {tuple(keys.shape)}, weights {tuple(weights.shape)}: "
            "batch, queries, heads or head dim disagree"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"indexer kernel: head dim {head_dim} is over the kernel's {MAX_HEAD_DIM}")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("indexer kernel: q, keys and weights need a contiguous last dimension")
    if q.dtype != keys.dtype or q.dtype not in OPERAND_DTYPES:
        raise ValueError(
            f"indexer kernel: q and keys must share one of {OPERAND_DTYPES}, got {q.dtype} and {keys.dtype}"
        )
    if weights.dtype != torch.float32 or (key_scale is not None and key_scale.dtype != torch.float32):
        raise ValueError("indexer kernel: weights and key scales must be fp32")
    if key_scale is not None and tuple(key_scale.shape) != tuple(keys.shape[:2]):
        raise ValueError(f"indexer kernel: key scales {tuple(key_scale.shape)}, keys {tuple(keys.shape)}")


@torch.library.custom_op("genomelm::indexer_scores", mutates_args=())
def indexer_scores(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    key_scale: Tensor | None,
    start: int,
    kpool: int,
    scale: float,
) -> Tensor:
    """Index scores of queries at global positions start..start+M-1 against pools 0..P-1: [B, M, P] fp32
    (invisible pools finfo.min).

    q [B, M, H, D] and keys [B, P, D] in one dtype (bf16 / fp16 / fp32 / float8_e4m3fn); weights [B, M, H]
    fp32, the head weights with every factor outside the ReLU folded in (heads^-0.5, fp8 query scales);
    key_scale [B, P] fp32 or None: multiplies the dot products with `scale` before the ReLU.
    """
    check_shapes(q, keys, weights, key_scale)
    batch, queries, heads, head_dim = q.shape
    n_pools = keys.shape[1]
    out = torch.empty((batch, queries, n_pools), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_m, block_n, warps = tile_config()
    scales = key_scale if key_scale is not None else weights  # any pointer: unused without key scales
    # pool tiles vary fastest: the programs running at once share a query tile, read from HBM once, while
    # the keys (4 MiB at a 64k window) stay in L2
    grid = (triton.cdiv(n_pools, block_n), triton.cdiv(queries, block_m), batch)
    if max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(
            f"indexer kernel: {queries} queries (tiles of {block_m}) x batch {batch} exceed CUDA's grid of "
            f"{MAX_GRID_YZ}: score fewer queries per call"
        )
    _index_scores_kernel[grid](
        q,
        keys,
        weights,
        scales,
        out,
        queries,
        n_pools,
        heads,
        head_dim,
        start,
        scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        weights.stride(0),
        weights.stride(1),
        scales.stride(0),
        out.stride(0),
        out.stride(1),
        KPOOL=kpool,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        HAS_KEY_SCALE=key_scale is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    return out


@indexer_scores.register_fake
def _indexer_scores_fake(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    key_scale: Tensor | None,
    start: int,
    kpool: int,
    scale: float,
) -> Tensor:
    check_shapes(q, keys, weights, key_scale)
    return q.new_empty((q.shape[0], q.shape[1], keys.shape[1]), dtype=torch.float32)


def indexer_scores_flops(q_shape: torch.Size, n_pools: int, start: int, kpool: int) -> int:
    """FLOPs of one call as the kernel runs it: per query tile, the pool tiles up to the last one its last
    query can see (the rest are skipped), 2*D per dot product and 2 for the head-weighted sum per (query,
    head, pool); the scale and ReLU are not counted, as FlopCounterMode counts the torch path's matmuls
    only."""
    batch, queries, heads, head_dim = q_shape
    block_m, block_n, _ = tile_config()
    flops = 0
    for first in range(0, queries, block_m):
        rows = min(block_m, queries - first)
        last = start + first + rows - 1  # the tile's last query position
        if last < kpool - 1:
            continue
        cols = min(n_pools, ((last - kpool + 1) // (block_n * kpool) + 1) * block_n)
        flops += 2 * (head_dim + 1) * batch * rows * heads * cols
    return flops


@register_flop_formula(torch.ops.genomelm.indexer_scores)
def _indexer_scores_flop_formula(
    q_shape, keys_shape, weights_shape, key_scale_shape, start, kpool, scale, out_shape=None, **kwargs
) -> int:
    return indexer_scores_flops(q_shape, keys_shape[1], start, kpool)


def indexer_scores_traffic(
    q_shape: tuple[int, ...], n_pools: int, operand_bytes: int, block_m: int = 64
) -> int:
    """HBM bytes one call reads and writes (an upper estimate): q once, the keys (and key scales) once per
    tile of `block_m` queries (L2 serves most of those when the keys fit it, as a 64k window's 4 MiB do),
    the fp32 weights, and the [B, M, P] fp32 output."""
    batch, queries, heads, head_dim = q_shape
    query_tiles = -(-queries // block_m)
    reads = batch * queries * heads * head_dim * operand_bytes
    reads += batch * query_tiles * n_pools * (head_dim * operand_bytes + 4)
    reads += batch * queries * heads * 4
    return reads + batch * queries * n_pools * 4


def indexer_scores_bytes(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    key_scale: Tensor | None,
    start: int,
    kpool: int,
    scale: float,
) -> int:
    """`indexer_scores_traffic` of one call, from the op's own arguments (the roofline's convention)."""
    return indexer_scores_traffic(tuple(q.shape), keys.shape[1], q.element_size(), tile_config()[0])
