"""The long-context memory stack the trainer wraps around the model: the recompute policy and host offload.

Recompute is decided here, once, and reaches the model only through its seams (the `layer_runner` argument and
the blocks' `chunk_runner`):
- `recompute=true`: each decoder layer runs under non-reentrant `torch.utils.checkpoint`: the layer keeps only
  its input for the backward pass and recomputes everything else once; side outputs such as the DSA indexer's
  KL term keep their graph (the recompute fills it in). A DSA layer may also keep its top-k selection (int32
  [S, index_topk / index_kpool]) so the recompute does not run the indexer again. The expert forward runs
  twice per step.
- `recompute_chunks=true`: additionally each chunk of the MoE, the dense MLP and the indexer KL term is
  checkpointed on its own, so a layer's backward holds one chunk's activations instead of the layer's (for
  very long local sequences; the chunk forward then runs three times per step).
- `offload=true`: what a layer keeps for its backward lives in host memory until the backward needs it: with
  recompute, the layer input (`_KeptInput`); without, every tensor autograd saves (`HostOffload`). On CUDA the
  copies run on a side stream into pinned buffers so they overlap compute; on the CPU they are plain copies
  (which keeps the path exercised and testable).

We write the host copies rather than use `torch.autograd.graph.save_on_cpu` because that copies on the compute
stream and blocks it; the side stream is the point on a GPU. The layer input needs its own holder because
non-reentrant checkpoint keeps the checkpointed function's arguments alive itself, outside the saved-tensor
hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from genomelm.model.chunking import run_directly
from genomelm.run.config import MemoryConfig

Packed = tuple[torch.device, Any]


class HostCopier:
    """Moves tensors to host memory and back; on CUDA through pinned buffers on a side stream."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.bytes_offloaded = 0

    def to_host(self, tensor: torch.Tensor) -> Packed:
        self.bytes_offloaded += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return tensor.device, tensor.detach().clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return tensor.device, (host, done)

    def to_device(self, packed: Packed) -> torch.Tensor:
        device, payload = packed
        if device.type != "cuda":
            return payload
        host, done = payload
        done.synchronize()
        with torch.cuda.stream(self.stream):
            back = host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(self.stream)
        back.record_stream(torch.cuda.current_stream(device))
        return back


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it live in host memory until the backward pass."""

    def __init__(self, copier: HostCopier) -> None:
        super().__init__(copier.to_host, copier.to_device)


class _KeptInput:
    """A checkpointed layer's input: the live tensor during the forward, then (with offload) a host copy that
    the recompute brings back, detached, with the original's `requires_grad` (gradients reach the original
    through the forward's graph, which non-reentrant checkpoint keeps)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.requires_grad = tensor.requires_grad
        self.packed: Packed | None = None
        self.copier: HostCopier | None = None

    def offload(self, copier: HostCopier) -> None:
        self.packed, self.copier, self.tensor = copier.to_host(self.tensor), copier, None

    def get(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        return self.copier.to_device(self.packed).detach().requires_grad_(self.requires_grad)


def checkpointed_chunk(fn: Callable[..., Any], *args: Any) -> Any:
    """A chunk runner that recomputes the chunk in backward (when gradients are on)."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def set_chunk_recompute(model: nn.Module, enabled: bool) -> None:
    """Point every chunking block's `chunk_runner` at `checkpointed_chunk` (enabled) or back to the
    default."""
    for module in model.modules():
        if hasattr(module, "chunk_runner"):
            module.chunk_runner = checkpointed_chunk if enabled else run_directly


@dataclass
class LayerRunner:
    """The model's `layer_runner` hook: runs one decoder layer with the configured memory switches."""

    recompute: bool
    offload: bool
    keep_selection: bool = True  # with recompute: keep each DSA layer's selection for the backward
    recompute_chunks: bool = False  # reported here; applied to the model by `set_chunk_recompute`

    def __post_init__(self) -> None:
        self.copier = HostCopier() if self.offload else None

    @classmethod
    def for_memory(cls, memory: MemoryConfig, offload: bool | None = None) -> LayerRunner:
        """The runner of a run's `memory` settings (`offload`: None keeps the setting's)."""
        return cls(
            recompute=memory.recompute,
            offload=memory.offload if offload is None else offload,
            keep_selection=memory.keep_selection,
            recompute_chunks=memory.recompute_chunks,
        )

    def __call__(self, layer: nn.Module, hidden: torch.Tensor, selection: Any) -> Any:
        if not torch.is_grad_enabled():
            return layer(hidden, selection)
        if not self.recompute:
            if self.copier is None:
                return layer(hidden, selection)
            with HostOffload(self.copier):
                return layer(hidden, selection)
        kept = _KeptInput(hidden)
        cache: dict | None = {} if self.keep_selection else None  # lives as long as this layer's graph

        def forward(shared: Any) -> Any:
            return layer(kept.get(), shared, cache)

        out = checkpoint(forward, selection, use_reentrant=False, preserve_rng_state=True)
        if self.copier is not None:
            kept.offload(self.copier)
        return out

    def describe(self) -> str:
        parts = ["recompute: full, per layer (non-reentrant)" if self.recompute else "recompute: off"]
        if self.recompute and self.keep_selection:
            parts.append("DSA selections kept for the recompute (the indexer runs once)")
        if self.recompute_chunks:
            parts.append("MoE / MLP / indexer-KL chunks recomputed one at a time")
        if self.offload:
            where = "pinned host buffers, side CUDA stream" if torch.cuda.is_available() else "host copies"
            what = "layer inputs" if self.recompute else "saved activations"
            parts.append(f"offload of saved {what}: on ({where})")
        else:
            parts.append("offload: off")
        return "; ".join(parts)
