"""What the sparse MLA Triton kernels share (`genomelm.model.dsa_triton`: forward and backward;
`genomelm.model.dsa_triton_mass`: the pool mass): their launch tiles, the shapes they refuse, the slot rule
as a Triton function, and the sizes their FLOP and byte estimates count."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from genomelm.model.backends import triton_interpreted

MAX_LATENT = 512  # latent width a program holds whole ([heads, L] fp32 accumulators in registers)
MAX_DETERMINISTIC_BYTES = 4 * 2**30  # the deterministic backward's per-slot parts: a test-size mode
LOG2E = math.log2(math.e)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: heads per program (the dots' M, at least 16), slots per tile (at least 16),
    warps and software-pipelining stages."""

    block_h: int
    block_w: int
    num_warps: int
    num_stages: int


# GPU tiles, not yet timed on a GPU, chosen by compiling ahead of time for sm_90 (no GPU needed:
# `benchmarks/kernel_dsa.py --compile-only`) as the largest without register spills at latent 512, bf16:
# forward ~140 registers a thread and 66 KiB shared, backward ~254 and 96 KiB. 64 heads a program spills
# (forward) or needs 288 KiB of shared memory (backward, over the H200's 227 KiB).
FORWARD_TILES = Tiles(block_h=32, block_w=32, num_warps=8, num_stages=2)
BACKWARD_TILES = Tiles(block_h=32, block_w=16, num_warps=8, num_stages=1)
INTERPRETER_TILES = Tiles(block_h=16, block_w=16, num_warps=4, num_stages=1)


def tiles(backward: bool = False) -> Tiles:
    """The launch configuration for the current mode (interpreter or GPU)."""
    if triton_interpreted():
        return INTERPRETER_TILES
    return BACKWARD_TILES if backward else FORWARD_TILES


def slot_count(pools_per_query: int, kpool: int, select_tail: bool) -> int:
    """W: slots per query, K * kpool pool tokens plus the kpool - 1 tail tokens when `select_tail`."""
    return pools_per_query * kpool + (kpool - 1 if select_tail and kpool > 1 else 0)


def check_inputs(q_lat: Tensor, latent: Tensor, pools: Tensor, positions: Tensor) -> None:
    """Raise ValueError naming the shape or dtype the kernels cannot take."""
    if q_lat.dim() != 4 or latent.dim() != 3:
        raise ValueError(
            f"sparse MLA kernel takes q_lat [B, n, H, L] and latent [B, S, L], got {tuple(q_lat.shape)} and "
            f"{tuple(latent.shape)}"
        )
    batch, queries, _, width = q_lat.shape
    if latent.shape[0] != batch or latent.shape[2] != width:
        raise ValueError(f"latent {tuple(latent.shape)} does not match q_lat {tuple(q_lat.shape)}")
    if width > MAX_LATENT:
        raise ValueError(
            f"sparse MLA kernel holds the latent row whole: latent width L={width} > {MAX_LATENT}; use "
            "dsa_backend='sparse'"
        )
    if q_lat.dtype != latent.dtype or q_lat.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"sparse MLA kernel takes q_lat and latent in one of {KERNEL_DTYPES}, got {q_lat.dtype} and "
            f"{latent.dtype}; use dsa_backend='sparse'"
        )
    if pools.shape[:2] != (batch, queries) or positions.shape != (queries,):
        raise ValueError(
            f"selection pools {tuple(pools.shape)} / positions {tuple(positions.shape)} do not match "
            f"{queries} queries in {batch} rows"
        )


def check_pool_mass(kpool: int) -> None:
    """Raise ValueError unless the pool-mass kernel can sum whole pools of `kpool` slots per tile."""
    block_w = tiles().block_w
    if kpool > block_w or kpool & (kpool - 1):
        raise ValueError(
            f"sparse MLA pool mass sums whole pools in slot tiles of {block_w}: kpool={kpool} must be a "
            "power of two no larger; use dsa_backend='sparse'"
        )


def deterministic_bytes(q_lat: Tensor, pools_per_query: int, kpool: int, select_tail: bool) -> int:
    """Bytes of the deterministic backward's per-slot parts: [B*n*head_blocks, W padded, L] fp32."""
    batch, queries, heads, width = q_lat.shape
    tile = tiles(backward=True)
    padded = triton.cdiv(slot_count(pools_per_query, kpool, select_tail), tile.block_w) * tile.block_w
    return batch * queries * triton.cdiv(heads, head_block(heads, tile)) * padded * width * 4


def check_deterministic(q_lat: Tensor, pools_per_query: int, kpool: int, select_tail: bool) -> None:
    """Raise ValueError when the deterministic backward's parts would exceed `MAX_DETERMINISTIC_BYTES`."""
    size = deterministic_bytes(q_lat, pools_per_query, kpool, select_tail)
    if size > MAX_DETERMINISTIC_BYTES:
        raise ValueError(
            f"the deterministic sparse MLA backward stores every slot's d latent: {size / 2**30:.1f} GiB for "
            f"q_lat {tuple(q_lat.shape)}, over {MAX_DETERMINISTIC_BYTES / 2**30:.0f} GiB; turn "
            "torch.use_deterministic_algorithms off (fp32 atomics) or set dsa_backend='sparse'"
        )


def dot_precision(dtype: torch.dtype) -> str:
    """The dots' input precision: full fp32 ("ieee") for fp32 inputs (reference runs; not TF32's 10-bit
    mantissa), Triton's default for 16-bit inputs (where it changes nothing)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def contiguous_rows(t: Tensor) -> Tensor:
    """t itself when its last dimension is contiguous (the kernels take the other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def head_block(heads: int, tile: Tiles) -> int:
    return min(tile.block_h, max(16, triton.next_power_of_2(heads)))


# ------------------------------------------------------------------------------------------- the slot rule
@triton.jit
def slot_tokens(pools_row, w, position, K, KPOOL: tl.constexpr, TAIL: tl.constexpr):
    """Token numbers [BW] int64 of one query's slots w [BW] and whether each is a real slot: slot w < K *
    KPOOL is token w % KPOOL of the (w // KPOOL)-th selected pool (empty when that pool is -1); the next
    KPOOL - 1 slots are the tail pool, the (position + 1) % KPOOL tokens ending at the query; the rest
    (the last tile's padding) are empty."""
    pooled = w < K * KPOOL
    pool = tl.load(pools_row + w // KPOOL, mask=pooled, other=-1).to(tl.int64)
    token = pool * KPOOL + w % KPOOL
    valid = pooled & (pool >= 0)
    if TAIL:
        tail_count = (position + 1) % KPOOL
        offset = w - K * KPOOL
        token = tl.where(pooled, token, position + 1 - tail_count + offset)
        valid = valid | ((offset >= 0) & (offset < tail_count))
    return token, valid


# ------------------------------------------------------------------------------------------------- sizes
def pair_count(q_shape, pools_shape, kpool: int, select_tail: bool) -> int:
    """(query, head, slot) triples times L: the size of one of the kernel's dots."""
    batch, queries, heads, width = q_shape
    return batch * queries * heads * slot_count(pools_shape[-1], kpool, select_tail) * width


def gathered_bytes(q_lat: Tensor, slots: int) -> int:
    """HBM bytes of the latent rows the programs load: each query's `slots` rows once (its head blocks run
    side by side, so all but the first read of a row hit L2)."""
    batch, queries, _, width = q_lat.shape
    return batch * queries * slots * width * q_lat.element_size()
