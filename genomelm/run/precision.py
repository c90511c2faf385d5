"""The `precision` run setting: which autocast the trainer and the evaluator wrap the model in.

`bf16`: parameters stay fp32 (the optimizer's master weights); the large matmuls run in bf16 under autocast,
and the model keeps its own fp32 regions (see `genomelm.model.precision`). `fp32`: no autocast. `auto`: bf16
on CUDA, fp32 on the CPU. bf16 also runs on the CPU through CPU autocast, which is how the tests hold the
GPU's numerics.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS = ("auto", "bf16", "fp32")
REDUCE_DTYPES = ("fp32", "bf16")  # the `reduce_dtype` setting


def resolve_precision(precision: str, device: torch.device) -> str:
    """ "auto" -> "bf16" on CUDA, "fp32" elsewhere; "bf16" and "fp32" as given."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager:
    """The context the model's forward runs in for a resolved or "auto" `precision` on `device`."""
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def fsdp_param_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in for a run of `precision` on `device`: bf16 for bf16 runs, None
    (the parameters' own) otherwise."""
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else None


def fsdp_reduce_dtype(reduce: str) -> torch.dtype | None:
    """The dtype FSDP2 reduce-scatters gradients in for the `reduce_dtype` setting: bf16 for "bf16", None for
    "fp32" (fp32 gradients, or the fp32 reduction of bf16-gathered parameters: `shard_model`)."""
    if reduce not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES}, not {reduce!r}")
    return torch.bfloat16 if reduce == "bf16" else None
