"""The long-context memory stack the trainer wraps around every decoder layer.

- Full activation recompute per layer: `torch.utils.checkpoint` (reentrant form), so a layer keeps only
  its input for the backward pass and recomputes everything else; a DSA layer may also keep its top-k
  selection (int32 [S, index_topk / index_kpool]) so the recompute does not run the indexer again.
- CPU offload of that saved input: a `saved_tensors_hooks` pair moves each tensor autograd saves into
  host memory and brings it back when the backward pass needs it. On CUDA the copies run on a side
  stream into pinned buffers so they overlap compute; on the CPU they are plain copies (which keeps the
  path exercised and testable). Buffers belong to the step's autograd graph and are released with it.

We write the hooks rather than use `torch.autograd.graph.save_on_cpu` because that copies on the compute
stream and blocks it; the side stream is the point on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it live in host memory until the backward pass."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.bytes_offloaded = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.bytes_offloaded += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return tensor.device, tensor.clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return tensor.device, (host, done)

    def _unpack(self, packed: Any) -> torch.Tensor:
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


@dataclass
class LayerRunner:
    """The model's `layer_runner` hook: runs one decoder layer with the configured memory switches."""

    recompute: bool
    offload: bool
    keep_selection: bool = True  # with recompute: keep each DSA layer's selection for the backward

    def __post_init__(self) -> None:
        self.offload_hooks = HostOffload() if self.offload else None

    def __call__(self, layer: nn.Module, hidden: torch.Tensor, selection: Any) -> Any:
        run: Callable[[], Any]
        if self.recompute and torch.is_grad_enabled():
            cache: dict | None = {} if self.keep_selection else None  # lives as long as this layer's graph

            def forward(h: torch.Tensor, shared: Any) -> Any:
                return layer(h, shared, cache)

            def run() -> Any:
                return checkpoint(forward, hidden, selection, use_reentrant=True, preserve_rng_state=True)
        else:
            def run() -> Any:
                return layer(hidden, selection)
        if self.offload_hooks is not None and torch.is_grad_enabled():
            with self.offload_hooks:
                return run()
        return run()

    def describe(self) -> str:
        parts = ["recompute: full, per layer" if self.recompute else "recompute: off"]
        if self.recompute and self.keep_selection:
            parts.append("DSA selections kept for the recompute (the indexer runs once)")
        if self.offload:
            where = "pinned host buffers, side CUDA stream" if torch.cuda.is_available() else "host copies"
            parts.append(f"offload of saved layer inputs: on ({where})")
        else:
            parts.append("offload: off")
        return "; ".join(parts)
