"""Which implementation a block runs: the kernel switches' one rule.

Each switch (`RunOptions.indexer_backend`, `dsa_backend`, `mhc_backend`) names a torch path (the readable
reference, which runs anywhere) and a Triton kernel. "auto" takes the kernel on CUDA and the torch path
elsewhere; asking for the kernel where it cannot run is an error, never a quiet fall back to the torch path.
A Triton kernel runs on CPU tensors only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the
tests hold each kernel to its reference.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from genomelm.model.config import RunOptions

TRITON = "triton"


@functools.cache
def triton_installed() -> bool:
    """Whether the `triton` package can be imported (CUDA builds of torch ship it; the CPU build does not)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (`TRITON_INTERPRET=1`): on CPU tensors, slowly."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TRACING_KERNELS = False


@contextmanager
def tracing_kernels() -> Iterator[None]:
    """Inside, a Triton kernel counts as runnable on any device when triton is installed: for traces on fake
    tensors (the planner's), which call each kernel's custom op through its fake implementation and never run
    it, so a CPU trace can hold what the GPU step holds."""
    global _TRACING_KERNELS
    saved, _TRACING_KERNELS = _TRACING_KERNELS, True
    try:
        yield
    finally:
        _TRACING_KERNELS = saved


def kernels_traced() -> bool:
    """Whether a trace on fake tensors is under way (`tracing_kernels`): the GPU's kernels count as runnable
    on any device, fla's (through the planner's stand-ins) as well as Triton's."""
    return _TRACING_KERNELS


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of `device`: CUDA with triton installed, or any device
    under the interpreter (or inside `tracing_kernels`)."""
    return triton_installed() and (device.type == "cuda" or triton_interpreted() or kernels_traced())


def resolve_backend(
    switch: str, requested: str, choices: tuple[str, ...], torch_path: str, device: torch.device
) -> str:
    """Resolve one kernel switch for inputs on `device`.

    `switch` names the setting in messages (e.g. "dsa_backend"); `choices` its values besides "auto"; the
    Triton value is `TRITON`, `torch_path` the value "auto" takes off CUDA. Raises ValueError for an unknown
    value, for "auto" on CUDA without triton, and for "triton" where it cannot run.
    """
    if requested != "auto" and requested not in choices:
        raise ValueError(f"{switch} must be 'auto' or one of {choices}, got {requested!r}")
    if requested == "auto":
        if device.type != "cuda":
            return torch_path
        requested = TRITON
    if requested == TRITON and not triton_runs_on(device):
        if not triton_installed():
            raise ValueError(
                f"{switch}={TRITON} needs the triton package, which is not installed: pip install triton "
                f"(CUDA builds of torch ship it), or set {switch}={torch_path} to run the torch path"
            )
        raise ValueError(
            f"{switch}={TRITON} runs on CUDA tensors, or on the CPU under TRITON_INTERPRET=1; "
            f"the inputs are on {device.type}: set {switch}={torch_path} or auto"
        )
    return requested


# the kernel switches of `RunOptions`, with the torch path each takes when the kernel is not wanted
KERNEL_SWITCHES = {"indexer_backend": "torch", "dsa_backend": "sparse", "mhc_backend": "torch"}


def as_on_gpu(options: RunOptions) -> tuple[RunOptions, str | None]:
    """`options` with each kernel switch left at "auto" set as a CUDA device resolves it ("triton"), for a
    trace of the GPU's step on fake tensors of any device (inside `tracing_kernels`: each kernel's custom op
    runs its fake implementation). Without triton installed they take their torch paths instead, and the
    returned note says so (None otherwise)."""
    auto = [name for name in KERNEL_SWITCHES if getattr(options, name) == "auto"]
    if not auto:
        return options, None
    if triton_installed():
        return dataclasses.replace(options, **dict.fromkeys(auto, TRITON)), None
    torch_paths = {name: KERNEL_SWITCHES[name] for name in auto}
    note = (
        "triton is not installed here, so the GPU's Triton kernels were traced as their torch paths ("
        + ", ".join(f"{k}={v}" for k, v in torch_paths.items())
        + "): pip install triton to trace them"
    )
    return dataclasses.replace(options, **torch_paths), note
