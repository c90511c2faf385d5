"""Auxiliary-loss-free expert load balancing (DeepSeek-V3): after each optimizer step, each MoE layer's
`e_score_correction_bias` moves by `speed` towards balance: up for experts that got fewer tokens than the mean
over the step, down for those that got more. The bias steers only which experts are chosen, never their
weights.

Counts are summed over the step's micro-batches, from each forward's router statistics read once (an
activation recompute routes the same tokens again and is not counted twice).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ExpertLoad:
    """Tokens routed to each expert per MoE layer over one optimizer step."""

    def __init__(self) -> None:
        self.counts: dict[int, Tensor] = {}

    def add(self, router_stats: dict[int, Tensor]) -> None:
        """Add one forward's `model.router_stats()` ({layer: [E] long})."""
        for layer, counts in router_stats.items():
            self.counts[layer] = self.counts.get(layer, 0) + counts.detach().to(torch.float64)

    def max_over_mean(self) -> dict[int, float]:
        return {layer: float(c.max() / c.mean().clamp_min(1e-9)) for layer, c in self.counts.items()}

    def unused(self) -> dict[int, int]:
        return {layer: int((c == 0).sum()) for layer, c in self.counts.items()}


@torch.no_grad()
def update_expert_bias(layers: nn.ModuleList, load: ExpertLoad, speed: float) -> None:
    """bias_e += speed * sign(mean load - load_e) for every MoE layer in `load` (no-op when speed is 0)."""
    if speed == 0:
        return
    for layer, counts in load.counts.items():
        bias = layers[layer].mlp.gate.e_score_correction_bias
        bias.add_(speed * torch.sign(counts.mean() - counts).to(bias.dtype))
