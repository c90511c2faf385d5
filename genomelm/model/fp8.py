"""Block-scaled FP8 weights as GLM-5.3-Flash FP8 checkpoints store them.

A weight `W` [..., R, C] is stored as `float8_e4m3fn` values `Q` [..., R, C] plus `W_scale_inv`
[..., ceil(R / br), ceil(C / bc)] (fp32): one scale per br x bc block (128 x 128 in the checkpoint), the
last row and column blocks partial when R or C is not a multiple of the block. `W = Q.float() * scale`.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


class FP8Error(ValueError):
    """An FP8 weight whose block scales do not fit it."""


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def dequantize_fp8_blocks(
    quantized: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    name: str = "weight",
) -> torch.Tensor:
    """FP8 `quantized` [..., R, C] times its fp32 `scale_inv` [..., ceil(R/br), ceil(C/bc)], per block
    (br, bc) = `block` -> fp32 [..., R, C]."""
    if quantized.dim() < 2:
        raise FP8Error(f"{name}: FP8 block scaling needs 2 or more dims, got shape {tuple(quantized.shape)}")
    rows, cols = quantized.shape[-2:]
    block_rows, block_cols = block
    expected = (*quantized.shape[:-2], math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale_inv.shape) != expected:
        raise FP8Error(
            f"{name}: FP8 weight of shape {tuple(quantized.shape)} with {block_rows} x {block_cols} blocks "
            f"needs {name}{SCALE_SUFFIX} of shape {expected}, got {tuple(scale_inv.shape)}; check "
            "weight_block_size in config.json's quantization_config"
        )
    scale = scale_inv.float().repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block_cols, dim=-1)[..., :cols]
    return quantized.float() * scale
