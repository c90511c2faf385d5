"""Explicit fp32 regions inside an autocast forward, and the two dtypes the model computes in.

The model never turns autocast on; the trainer does (`precision=bf16`). Some math must stay fp32 whatever the
caller chose (router logits, mHC mixing and the residual combine, the KDA delta rule and its state, indexer
scores, the loss softmax): those regions run under `fp32_region`, which switches autocast off for the device
of the tensors involved, and cast their inputs to `at_least_fp32` themselves. Everything else (the large
projections, the expert GEMMs, sparse attention over gathered latents) follows the caller's autocast, in
`compute_dtype`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fp32_region(like: Tensor) -> torch.autocast:
    """Context manager: autocast off on `like`'s device type, so the ops inside run in their inputs' dtype."""
    return torch.autocast(like.device.type, enabled=False)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in here: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 / fp16 / fp32, fp64 for fp64: the dtype of the fp32 regions for inputs of `dtype`."""
    return torch.promote_types(dtype, torch.float32)
