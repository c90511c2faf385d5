"""Dense feed-forward block: SwiGLU with the checkpoint's clamping (gate <= limit, |up| <= limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chunking import ChunkRunner, run_directly
from .config import ModelConfig


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """`silu(min(gate, limit)) * clamp(up, -limit, limit)`, elementwise."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class MLP(nn.Module):
    """`down(swiglu(gate(x), up(x)))` with width `intermediate_size` (default: config.intermediate_size).

    With `chunk_tokens`, a sequence is processed that many tokens at a time through `chunk_runner` (the
    trainer may recompute each chunk in backward, so the [S, width] activations never exist at once).
    """

    def __init__(
        self, config: ModelConfig, intermediate_size: int | None = None, chunk_tokens: int | None = None
    ) -> None:
        super().__init__()
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.swiglu_limit = config.swiglu_limit
        self.chunk_tokens = chunk_tokens
        self.chunk_runner: ChunkRunner = run_directly
        chunks = f", chunks of {chunk_tokens} tokens" if chunk_tokens else ""
        self.route = f"mlp: dense swiglu, width {width}{chunks}"

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., D] -> [..., D]."""
        flat = x.reshape(-1, x.shape[-1])
        if not self.chunk_tokens or flat.shape[0] <= self.chunk_tokens:
            return self._swiglu(x)
        parts = [self.chunk_runner(self._swiglu, c) for c in flat.split(self.chunk_tokens)]
        return torch.cat(parts).view(*x.shape[:-1], -1)

    def _swiglu(self, x: Tensor) -> Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
