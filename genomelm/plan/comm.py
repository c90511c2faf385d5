"""What one rank moves per window, by collective, and the seconds it takes at the link of each group
(`rates.Links`): the traced context-parallel collectives scaled by layer, and the computed FSDP2, gradient
and expert-parallel ones (the exchange of the routed rows, and of the experts' copies); those that block the
compute apart from those on a side stream (`roofline.OVERLAP_RULE`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from genomelm.model import ModelConfig
from genomelm.plan import rates
from genomelm.plan.layouts import Assumptions, Layout
from genomelm.plan.memory import ParameterShare, ScaledTraces, copy_width
from genomelm.plan.rates import Peaks
from genomelm.run.config import TrainConfig


@dataclass
class _Tally:
    """Bytes one rank moves, by collective, and their seconds at the link of each collective's group
    (`rates.Links`): those that block the compute, and those on a side stream (`overlapped`)."""

    links: rates.Links
    imbalance: float
    bytes: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    overlapped: dict[str, float] = field(default_factory=dict)  # side-stream seconds by collective

    def add(
        self,
        name: str,
        moved: float,
        ranks: int,
        kind: str = "ring",
        overlapped: bool = False,
        sharing: int = 1,
    ) -> None:
        """`moved`: the bytes one rank moves over its links in a collective of `kind` ("all_to_all", else a
        ring), its node's NICs shared with `sharing` groups at once."""
        self.bytes[name] = self.bytes.get(name, 0.0) + moved
        seconds = self.links.seconds(kind, moved, ranks, sharing)
        if overlapped:
            self.overlapped[name] = self.overlapped.get(name, 0.0) + seconds
        else:
            self.seconds += seconds

    def traced(self, kind: str, payload: float, ranks: int) -> None:
        """A traced context-parallel collective of `payload` bytes (its full tensor): the bytes one rank moves
        are its ring factor's share (`rates.ring_factor`)."""
        self.add(f"cp {kind}", payload * rates.ring_factor(kind, ranks), ranks, kind)

    def traced_layers(self, model_config: ModelConfig, steps: ScaledTraces, cp: int) -> None:
        """The decoder layers' context-parallel collectives as traced, each layer by its kind's, on the line
        through the two traces."""
        lo, hi = steps.lo, steps.hi
        for i in range(model_config.num_hidden_layers):
            part = f"layers.{steps.rep_of[i]}"
            for kind, size in hi.comm.get(part, {}).items():
                self.traced(kind, steps.line(lo.comm.get(part, {}).get(kind, 0), size), cp)

    def expert_exchange(
        self,
        model_config: ModelConfig,
        layout: Layout,
        tokens: int,
        exchanges: int,
        width: int,
        label: str,
        overlapped: bool = False,
    ) -> None:
        """The busiest rank's all-to-alls of `exchanges` one-way exchanges per MoE layer (a dispatch or a
        combine, in one pass): tokens x top-k rows of hidden x `width` B each, x `imbalance`; `overlapped`:
        started ahead of the work that needs them (`ep_overlap`), on the side."""
        if layout.ep == 1:
            return
        ep = layout.ep
        moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types)
        rows = tokens * model_config.num_experts_per_tok
        per_exchange = rows * model_config.hidden_size * width * (ep - 1) / ep
        moved = per_exchange * exchanges * moe_layers * self.imbalance
        self.add(label, moved, ep, "all_to_all", overlapped)

    def expert_copies(
        self, model_config: ModelConfig, layout: Layout, weights: float, width: int, passes: int
    ) -> None:
        """The experts' `weights` the busiest rank sends and receives for copies (`expert_copies`) per MoE
        layer pass, `width` bytes each: fetched in the forward (and again in a layer's recompute), their
        gradients returned in the backward; `passes` exchanges per layer, blocking."""
        if layout.ep == 1 or weights == 0:
            return
        c = model_config
        moe_layers = sum(t == "sparse" for t in c.mlp_layer_types)
        per_pass = weights * 3 * c.hidden_size * c.moe_intermediate_size * width
        label = "ep copies' weights (forward, recompute) and gradients (backward)"
        self.add(label, passes * per_pass * moe_layers, layout.ep, "all_to_all")


def copy_exchanges(config: TrainConfig, layout: Layout) -> tuple[int, int]:
    """(bytes per weight, exchanges per MoE layer) of the experts' copies: fetched in the forward and, with a
    layer recompute, again in it; their gradients returned in the backward."""
    return copy_width(config, layout), 3 if config.memory.recompute else 2


def fsdp_groups(
    layout: Layout, rest: float, experts: float, gpus_per_node: int
) -> list[tuple[float, int, int]]:
    """FSDP2's collectives of `rest` parameters sharded over every rank and `experts` (all ep ranks' routed
    experts) over the ranks holding the same ones: per group, (what one rank moves, in the parameters' unit,
    the group's ranks, the groups running it through a node's NICs at once: every ep-th rank is a group, so
    min(ep, GPUs per node) of them)."""
    world, ep = layout.world, layout.ep
    edp = world // ep
    return [
        (rest * (world - 1) / world, world, 1),
        (experts / ep * (edp - 1) / edp, edp, min(ep, gpus_per_node)),
    ]


def comm_bytes(
    model_config: ModelConfig,
    layout: Layout,
    params: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
    p: Peaks,
    overlap: bool,
    copies: tuple[int, int],
    reduced: int = 4,
) -> tuple[dict[str, float], float, dict[str, float]]:
    """Bytes one rank moves per window (the traced context-parallel collectives scaled by layer, plus the
    computed FSDP, gradient and expert-parallel ones), and their seconds at the link each group runs over:
    those that block the compute, and those on the side (FSDP2's; with `overlap`, the expert exchanges
    started ahead). `copies`: the bytes per weight and exchanges per MoE layer of the experts' copies
    (`copy_exchanges`); `reduced`: bytes per gradient value of FSDP2's reduce-scatter (`reduce_bytes`)."""
    hi, cp, world = steps.hi, layout.cp, layout.world
    tally = _Tally(p.links, a.imbalance)
    tally.traced_layers(model_config, steps, cp)
    for kind, size in hi.comm.get("rest", {}).items():
        if not (kind == "all_reduce" and size > 1024):  # not the packed gradient sum (computed below)
            tally.traced(kind, size, cp)
    if layout.sharded:  # on FSDP2's own streams
        for moved, ranks, sharing in fsdp_groups(
            layout, params.total - params.experts, params.experts, p.links.gpus_per_node
        ):
            label = "fsdp all_gather (bf16, forward + recompute)"
            tally.add(label, 2 * 2 * moved, ranks, overlapped=True, sharing=sharing)
            label = f"fsdp reduce_scatter ({'bf16' if reduced == 2 else 'fp32'} gradients)"
            tally.add(label, reduced * moved, ranks, overlapped=True, sharing=sharing)
    elif world > 1:  # every rank's gradients summed (one packed all-reduce; ring: twice the bytes)
        tally.add("gradient all_reduce (fp32)", 2 * 4 * params.local * (world - 1) / world, world)
    tokens = steps.tokens  # bf16 rows, a dispatch and a combine in each of the forward, recompute, backward
    if overlap:  # started ahead: all but the backward's reverse dispatch
        ahead = "ep all_to_all started ahead (dispatch + combine; forward, recompute; backward combine)"
        tally.expert_exchange(model_config, layout, tokens, 5, 2, ahead, overlapped=True)
        tally.expert_exchange(model_config, layout, tokens, 1, 2, "ep all_to_all (backward dispatch)")
    else:
        label = "ep all_to_all (dispatch + combine; forward, recompute, backward)"
        tally.expert_exchange(model_config, layout, tokens, 6, 2, label)
    tally.expert_copies(model_config, layout, a.copy_weights, copies[0], copies[1])
    return tally.bytes, tally.seconds, tally.overlapped


def forward_comm_bytes(
    model_config: ModelConfig,
    layout: Layout,
    stored: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
    p: Peaks,
    stored_in_bf16: bool,
    overlap: bool,
) -> tuple[dict[str, float], float, dict[str, float]]:
    """Bytes one rank moves in the evaluator's forward at `steps.tokens` per rank (the traced
    context-parallel collectives, the losses' all-gather among them; every FSDP unit gathered once, as
    stored; the expert all-to-all once, in bf16 with `stored_in_bf16`, else fp32), and their seconds."""
    lo, hi = steps.lo, steps.hi
    tally = _Tally(p.links, a.imbalance)
    tally.traced_layers(model_config, steps, layout.cp)
    for kind, size in hi.comm.get("rest", {}).items():  # the per-token losses: linear in the tokens
        tally.traced(kind, steps.line(lo.comm.get("rest", {}).get(kind, 0), size), layout.cp)
    if layout.sharded:  # on FSDP2's own streams
        for moved, ranks, sharing in fsdp_groups(
            layout, stored.total - stored.experts, stored.experts, p.links.gpus_per_node
        ):
            tally.add("fsdp all_gather (as stored, forward)", moved, ranks, overlapped=True, sharing=sharing)
    width = 2 if stored_in_bf16 else 4  # the rows in the compute dtype
    ahead = " started ahead" if overlap else ""
    label = f"ep all_to_all{ahead} (dispatch + combine; forward)"
    tally.expert_exchange(model_config, layout, steps.tokens, 2, width, label, overlapped=overlap)
    return tally.bytes, tally.seconds, tally.overlapped
