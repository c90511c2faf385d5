"""The routed load per expert, and what a run does with it.

Auxiliary-loss-free expert load balancing (DeepSeek-V3): after each optimizer step, each MoE layer's
`e_score_correction_bias` moves by `speed` towards balance: up for experts that got fewer tokens than the mean
over the step, down for those that got more. The bias steers only which experts are chosen, never their
weights.

Counts are summed over the step's micro-batches, from each forward's router statistics read once (an
activation recompute routes the same tokens again and is not counted twice). Their totals since the run's
first step (`RoutedTotals`) place the experts over the expert-parallel ranks at each resume
(`expert_placements`, `expert_placement=balanced`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from genomelm.data.errors import space_checked
from genomelm.parallel.placement import Placement, placement_with_replicas, static_placement
from genomelm.run.metrics import EXPERT_LOAD_FILE, EXPERT_PLACEMENT_FILE, SPACE_ADVICE


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


class RoutedTotals:
    """Tokens routed to each expert per MoE layer since the run's first step, over every rank: kept in the
    checkpoint (a resumed run counts on from it) and written beside it as `runs/<run>/expert_load.json`, the
    measured load that `genomelm.parallel.placement.balanced_placement` and `benchmarks/moe_balance.py
    --load` read."""

    def __init__(self) -> None:
        self.counts: dict[int, Tensor] = {}  # [E] float64 on the counts' device: read only when saved
        self.steps = 0

    def add(self, load: ExpertLoad) -> None:
        """One optimizer step's counts (already summed over the ranks), added on their device."""
        for layer, counts in load.counts.items():
            before = self.counts.get(layer)
            self.counts[layer] = counts if before is None else before.to(counts.device) + counts
        self.steps += 1

    def state(self) -> dict:
        counts = {str(k): v.tolist() for k, v in sorted(self.counts.items())}
        return {"steps": self.steps, "counts": counts}

    def load(self, state: dict | None) -> None:
        """From a checkpoint's `state()` (None: a checkpoint written before the totals were kept)."""
        state = state or {"steps": 0, "counts": {}}
        self.steps = state["steps"]
        self.counts = {int(k): torch.tensor(v, dtype=torch.float64) for k, v in state["counts"].items()}

    def write(self, run_dir: Path, step: int) -> None:
        """`expert_load.json` as of optimizer step `step` (temporary name, renamed into place)."""
        text = json.dumps({"through_step": step, **self.state()}) + "\n"
        _write_in_place(Path(run_dir) / EXPERT_LOAD_FILE, text, "the routed load per expert")


def _write_in_place(path: Path, text: str, what: str) -> None:
    """`text` to `path` under a temporary name, renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with space_checked(path, len(text), what, SPACE_ADVICE):
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class PlacedLayer:
    """One MoE layer's placement by load, and the busiest EP rank's rows over the mean rank's under the
    static blocks and under it (for that load)."""

    placement: Placement
    static: float
    placed: float


def expert_placements(routed: dict | None, experts: int, ep: int, copies: int = 0) -> dict[int, PlacedLayer]:
    """Each MoE layer's experts placed over `ep` ranks by the routed totals `routed` (`RoutedTotals.state()`
    of the checkpoint a run resumes from; None or no steps yet: {}, the static blocks) so that the busiest
    rank gets the fewest rows (`placement_with_replicas`: each expert owned by one rank, and with `copies`
    slots per rank, copies of the hottest where they help); by MoE layer index."""
    if routed is None or not routed.get("steps") or ep == 1:
        return {}
    placed = {}
    for layer, counts in sorted(routed["counts"].items(), key=lambda item: int(item[0])):
        placement = placement_with_replicas(counts, ep, copies)
        static = static_placement(experts, ep).busiest_over_mean(counts)
        placed[int(layer)] = PlacedLayer(placement, static, placement.busiest_over_mean(counts))
    return placed


def write_placements(run_dir: Path, placed: dict[int, PlacedLayer], ep: int, through_step: int) -> None:
    """`expert_placement.json`: the run's placement (per MoE layer, each rank's experts slot by slot: the
    experts / ep it owns, then its copies of others') and each layer's busiest/mean before and after it
    (temporary name, renamed into place)."""
    layers = {
        str(layer): {
            "slots": [list(rank) for rank in p.placement.slots],
            "static": p.static,
            "placed": p.placed,
        }
        for layer, p in placed.items()
    }
    text = json.dumps({"ep": ep, "load_through_step": through_step, "layers": layers}) + "\n"
    _write_in_place(Path(run_dir) / EXPERT_PLACEMENT_FILE, text, "the placement of the experts")


@torch.no_grad()
def update_expert_bias(layers: nn.ModuleList, load: ExpertLoad, speed: float) -> None:
    """bias_e += speed * sign(mean load - load_e) for every MoE layer in `load` (no-op when speed is 0)."""
    if speed == 0:
        return
    for layer, counts in load.counts.items():
        bias = layers[layer].mlp.gate.e_score_correction_bias
        bias.add_(speed * torch.sign(counts.mean() - counts).to(bias.dtype))
