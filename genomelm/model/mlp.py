"""Dense feed-forward block: SwiGLU with the checkpoint's clamping (gate <= limit, |up| <= limit)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """`silu(min(gate, limit)) * clamp(up, -limit, limit)`, elementwise."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class MLP(nn.Module):
    """`down(swiglu(gate(x), up(x)))` with width `intermediate_size` (default: config.intermediate_size)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.swiglu_limit = config.swiglu_limit
        self.path = f"mlp: dense swiglu, width {width}"

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., D] -> [..., D]."""
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
