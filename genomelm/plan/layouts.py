"""The planner's types: the GPUs it knows, what its projection assumes (from the run's settings and
metrics), a layout of the GPUs and its verdict."""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from genomelm.parallel.placement import (
    layers_busiest_over_mean,
    placement_with_replicas,
    static_placement,
    zipf_load,
)
from genomelm.run.config import PlanConfig, TrainConfig
from genomelm.run.metrics import EXPERT_LOAD_FILE, read_expert_load, read_metrics

GIB = 2**30
GPUS = {  # usable device memory (GiB), dense bf16 datasheet peak (TFLOP/s)
    "b200": (178.0, 2250.0),
    "h200": (139.0, 989.0),
}
ASSUMED_IMBALANCE = 4.0  # busiest expert-parallel rank's tokens over the mean when neither set nor measured
PUBLISHED_EP = 32  # the reference recipe's expert parallelism (EP32 x ETP2), where it measured about 4x
# The load model's expert orders: each MoE layer's router puts its hot experts in an order of its own, so a
# step's busiest/mean is the expectation over orders (the sum over ~40 MoE layers of the busiest rank's rows
# over the sum of the mean's), not one order's; its spread is the quantiles over the orders (`LOAD_RANGE`).
LOAD_ORDERS = 200
LOAD_RANGE = (0.1, 0.9)  # the orders' quantiles the range's optimistic and pessimistic ends take; memory is
# sized for a layer at the pessimistic one (a step's peak is its busiest MoE layer's)
# the `plan` settings the projection takes as given (`imbalance` is set, measured or assumed)
SETTINGS = (
    "mfu",
    "tflops",
    "nvlink_gbs",
    "nic_gbs",
    "nics_per_node",
    "pcie_gbs",
    "gpus_per_node",
    "host_gib",
    "trace_tokens",
)


@dataclass
class Assumptions:
    """What the projection assumes: the run's `plan` settings (`PlanConfig` has the defaults and their
    meaning), `imbalance` set, measured from the run's metrics or assumed (`load_assumptions`)."""

    mfu: float = PlanConfig.mfu
    tflops: float = PlanConfig.tflops  # 0: from the GPU (`resolved`)
    nvlink_gbs: float = PlanConfig.nvlink_gbs  # 0: the GPU's attainable rate (`rates.peaks`)
    nic_gbs: float = PlanConfig.nic_gbs
    nics_per_node: int = PlanConfig.nics_per_node
    pcie_gbs: float = PlanConfig.pcie_gbs
    gpus_per_node: int = PlanConfig.gpus_per_node
    host_gib: float = PlanConfig.host_gib
    imbalance: float = ASSUMED_IMBALANCE  # the expectation: what the projection's expected figure takes
    imbalance_source: str = "assumed (4x the mean)"
    # the range's ends (`LOAD_RANGE`): the optimistic and the pessimistic busiest/mean (0: as `imbalance`)
    imbalance_low: float = 0.0
    imbalance_high: float = 0.0
    trace_tokens: int = PlanConfig.trace_tokens
    case: str = "expected"  # the rates' end this projection takes (`rates.CASES`)
    # the run places its experts by load (`expert_placement=balanced`): a logged or modelled load's imbalance
    # is taken after placement, else under the static blocks (and the placement shown beside)
    placed: bool = False
    copies: int = 0  # the placement's copy slots per rank (`expert_copies`)
    # where placed: the static blocks' imbalance (a run places its experts at resume, so it starts on the
    # static blocks: memory is sized for them), and the experts' weights the busiest rank sends and
    # receives for copies per MoE layer pass (`Placement.copy_weights`)
    static_imbalance: float = 0.0
    static_high: float = 0.0
    copy_weights: float = 0.0
    # from a run's expert_load.json (`logged_imbalance`): busiest/mean of the static blocks at each ep, and
    # under a placement by load
    logged_experts: int = 0
    logged_static: dict[int, float] = field(default_factory=dict)
    logged_placed: dict[int, float] = field(default_factory=dict)
    # the layers' quantiles (`LOAD_RANGE`) of busiest/mean at each ep: (static low, high, placed low, high)
    logged_range: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    logged_copy_weights: dict[int, float] = field(default_factory=dict)  # mean over the layers
    # neither set nor measured: the imbalance at each ep from `assumed_load` (where its model applies)
    load_model: bool = True

    def resolved(self, gpu: str) -> Assumptions:
        """A copy with the GPU's own datasheet bf16 peak where `tflops` is 0."""
        if gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, not {gpu!r}")
        return dataclasses.replace(self, tflops=self.tflops or GPUS[gpu][1])

    def at_ep(self, ep: int, experts: int) -> Assumptions:
        """A copy for a layout with `ep` expert-parallel ranks of a model with `experts` routed experts: the
        imbalance its run's logged load gives there (when that load is of as many experts: the layers'
        aggregate, their quantiles the range), else the load model's (the expectation over expert orders,
        their quantiles the range); under the static blocks, or after placement by load where the run places
        its experts."""
        if self.logged_experts == experts and ep in self.logged_static:
            static, placed = self.logged_static[ep], self.logged_placed[ep]
            static_low, static_high, placed_low, placed_high = self.logged_range[ep]
            traffic = self.logged_copy_weights[ep]
            source = f"measured (expert_load.json, {self._placement_text(ep, static, placed)})"
        elif self.load_model and ep > 1 and (model := assumed_load(experts, ep, self.copies)) is not None:
            static, placed, traffic = model.static, model.placed, model.copy_weights
            static_low, static_high, placed_low, placed_high = model.static_range + model.placed_range
            source = (
                f"assumed: a Zipf load (s={model.exponent:.3f}) whose static blocks give "
                f"{ASSUMED_IMBALANCE:g}x at ep={PUBLISHED_EP} as published, averaged over {LOAD_ORDERS} "
                f"expert orders (quantiles {LOAD_RANGE[0]:g}-{LOAD_RANGE[1]:g}: "
                f"{static_low:.2f}-{static_high:.2f}); "
                f"{self._placement_text(ep, static, placed)}"
            )
        else:
            return self
        if not self.placed:
            return dataclasses.replace(
                self,
                imbalance=static,
                imbalance_low=static_low,
                imbalance_high=static_high,
                imbalance_source=source,
            )
        return dataclasses.replace(
            self,
            imbalance=placed,
            imbalance_low=placed_low,
            imbalance_high=placed_high,
            imbalance_source=source,
            static_imbalance=static,
            static_high=static_high,
            copy_weights=traffic,
        )

    def at_case(self, case: str) -> Assumptions:
        """A copy for one end of the range (`rates.CASES`): "low" (the fewest tokens/s) takes the pessimistic
        busiest/mean as its imbalance, "high" the optimistic one, "expected" the expectation."""
        if case == "expected":
            return dataclasses.replace(self, case=case)
        end = self.imbalance_high if case == "low" else self.imbalance_low
        return dataclasses.replace(self, case=case, imbalance=end or self.imbalance)

    @property
    def sized_imbalance(self) -> float:
        """The imbalance memory is sized for: a busy layer's (the pessimistic quantile), the static blocks'
        where the run starts on them."""
        return max(self.imbalance, self.imbalance_high, self.static_imbalance, self.static_high)

    def _placement_text(self, ep: int, static: float, placed: float) -> str:
        copies = f" and {self.copies} copy slot(s) per rank" if self.copies else ""
        if self.placed:
            return f"placed by load{copies} at ep={ep}: {placed:.2f}, the static blocks {static:.2f}"
        return f"the static blocks at ep={ep}; placed by load {placed:.2f} with expert_placement=balanced"


class LoadModel(NamedTuple):
    """The load model's busiest/mean at one ep: the Zipf exponent, the expectation over expert orders under
    the static blocks and placed by load, the `LOAD_RANGE` quantiles of each, and the copies' traffic."""

    exponent: float
    static: float
    placed: float
    static_range: tuple[float, float]
    placed_range: tuple[float, float]
    copy_weights: float  # the copies' weights the busiest rank moves per layer pass


@functools.cache
def _orders(experts: int, orders: int) -> np.ndarray:
    """[orders, experts]: row i the experts from the hottest down, in the order `zipf_load(seed=i)` draws."""
    rows = []
    for seed in range(orders):
        order = list(range(experts))
        random.Random(seed).shuffle(order)
        rows.append(order)
    return np.array(rows)


def static_ratios(experts: int, ep: int, exponent: float, orders: int = LOAD_ORDERS) -> np.ndarray:
    """[orders]: the static blocks' busiest/mean at `ep` under the Zipf load of `exponent` in each of
    `orders` expert orders (`zipf_load` with seeds 0 .. orders - 1)."""
    weights = 1.0 / np.arange(1, experts + 1) ** exponent
    weights *= experts / weights.sum()
    ranks = _orders(experts, orders) // (experts // ep)  # the rank of each of the k-th hottest experts
    loads = np.zeros((orders, ep))
    np.add.at(loads, (np.arange(orders)[:, None], ranks), weights[None, :])
    return loads.max(1) / (experts / ep)


@functools.cache
def fitted_exponent(experts: int) -> float:
    """The Zipf exponent whose static blocks give `ASSUMED_IMBALANCE` at `PUBLISHED_EP` in expectation over
    `LOAD_ORDERS` orders (bisection: the expectation grows with the exponent)."""
    lo, hi = 0.0, 8.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if static_ratios(experts, PUBLISHED_EP, mid).mean() < ASSUMED_IMBALANCE:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _quantiles(values: np.ndarray | list[float]) -> tuple[float, float]:
    low, high = np.quantile(np.asarray(values), LOAD_RANGE)
    return float(low), float(high)


@functools.cache
def assumed_load(experts: int, ep: int, copies: int = 0) -> LoadModel | None:
    """The load model of an unmeasured run at `ep` (`LoadModel`): experts loaded as 1 / k**s, each MoE layer
    in a random order of its own, s fitted so the static blocks give the published ~4x at the published
    ep=32 in expectation; placed by load with `copies` copy slots per rank (a packing of the loads whatever
    their order: one order gives it, no range). None where it does not apply (32 or ep not dividing
    `experts`)."""
    if experts % PUBLISHED_EP or experts % ep:
        return None
    exponent = fitted_exponent(experts)
    static = static_ratios(experts, ep, exponent)
    load = zipf_load(experts, exponent)
    placement = placement_with_replicas(load, ep, copies)
    placed = placement.busiest_over_mean(load)
    return LoadModel(
        exponent,
        float(static.mean()),
        placed,
        _quantiles(static),
        (placed, placed),
        float(placement.copy_weights(experts, ep)),
    )


def load_assumptions(config: TrainConfig) -> Assumptions:
    """Assumptions from the run's `plan` settings and, unless `imbalance` is set, the run's metrics."""
    settings = config.plan
    values: dict[str, Any] = {name: getattr(settings, name) for name in SETTINGS}
    # training places its experts by load where set; the evaluation runs the static blocks
    values["placed"] = config.parallel.expert_placement == "balanced" and config.plan.stage == "train"
    values["copies"] = config.parallel.expert_copies
    if settings.imbalance > 0:
        values |= {"imbalance": settings.imbalance, "imbalance_source": "set", "load_model": False}
    elif (measured := measured_imbalance(config)) is not None:
        values |= {
            "imbalance": measured[0],
            "imbalance_source": f"measured (runs/{config.run}/metrics.jsonl, {measured[1]})",
            "load_model": False,
        }
    if settings.imbalance == 0 and (config.run_dir / EXPERT_LOAD_FILE).exists():
        values |= logged_imbalance(config.run_dir / EXPERT_LOAD_FILE, config.parallel.expert_copies)
    return Assumptions(**values)


def logged_imbalance(path: Path, copies: int = 0) -> dict[str, Any]:
    """From a run's expert_load.json: the MoE layers' busiest/mean (summed over layers as the step adds them)
    under the static blocks and under a placement by load (with `copies` copy slots per rank), the layers'
    `LOAD_RANGE` quantiles of each, and the
    placement's copies' weights the busiest rank moves per layer pass (mean over the layers), at every
    power-of-two ep dividing the experts (the `logged_*` fields of `Assumptions`)."""
    layers = read_expert_load(path)
    experts = len(next(iter(layers.values()))) if layers else 0
    eps = [2**k for k in range(1, experts.bit_length()) if experts % 2**k == 0]
    logged: dict[str, Any] = {"logged_experts": experts, "logged_static": {}, "logged_placed": {}}
    logged["logged_copy_weights"], logged["logged_range"] = {}, {}
    for ep in eps:
        placed = {layer: placement_with_replicas(load, ep, copies) for layer, load in layers.items()}
        static = dict.fromkeys(layers, static_placement(experts, ep))
        logged["logged_static"][ep] = layers_busiest_over_mean(layers, static)
        logged["logged_placed"][ep] = layers_busiest_over_mean(layers, placed)
        logged["logged_range"][ep] = _quantiles(
            [static[layer].busiest_over_mean(load) for layer, load in layers.items()]
        ) + _quantiles([placed[layer].busiest_over_mean(load) for layer, load in layers.items()])
        moved = [p.copy_weights(experts, ep) for p in placed.values()]
        logged["logged_copy_weights"][ep] = sum(moved) / max(len(moved), 1)
    return logged


def measured_imbalance(config: TrainConfig) -> tuple[float, str] | None:
    """The busiest expert-parallel rank's rows over the mean as runs/<run>/metrics.jsonl logged them: the
    largest `ep/busiest_over_mean` (a run with ep > 1), else the largest `router/<layer>/max_over_mean` (the
    busiest expert over the mean: the bound of a rank's share at any ep); None without either. With the key
    it came from."""
    path = config.run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    ranks, experts = [], []
    for record in read_metrics(path):
        ranks += [v for k, v in record.items() if k == "ep/busiest_over_mean"]
        experts += [v for k, v in record.items() if k.startswith("router/") and k.endswith("/max_over_mean")]
    if ranks:
        return max(ranks), "ep/busiest_over_mean"
    return (max(experts), "router max_over_mean") if experts else None


@dataclass(frozen=True)
class Layout:
    """dp x cp ranks, the routed experts split over ep of them, and what FSDP2 does over the dp*cp ranks."""

    dp: int
    cp: int
    ep: int
    sharded: bool  # FSDP2 shards parameters, gradients and optimizer state over dp*cp > 1 ranks (fsdp=true)
    optimizer_offload: bool  # FSDP2 keeps the parameters, gradients and optimizer state in host memory
    optimizer: str = "adamw"  # the run's `optimizer` (`genomelm.run.config.OPTIMIZERS`)

    @property
    def world(self) -> int:
        return self.dp * self.cp


@dataclass
class EvalTime:
    """The evaluation's projected time (`plan_time.evaluation_time`): one window's forward over the layout's
    cp ranks, the context cut's, and the whole before/after evaluation of the held-out set, its windows split
    over the dp replicas."""

    window_s: float  # one full window's forward
    cut_tokens: int  # tokens of the context cut's forward (0: not scored)
    cut_s: float  # its forward
    windows: int | None  # held-out windows scored by each model (None: unknown)
    windows_source: str  # where `windows` came from
    per_replica: int | None  # windows the busiest dp replica scores: ceil(windows / dp)
    models: int  # models scored: before and after training
    total_s: float | None  # models x per_replica x (window_s + cut_s)


@dataclass
class Plan:
    """One layout's verdict (bytes per rank, per node; FLOPs; projected speed). For the evaluation
    (stage="eval"), `step_s` and `comm_bytes_per_step` are one window's forward, `tokens_per_s_projected` the
    window tokens the layout scores per second (the context cut's forward included) and `evaluation` the
    evaluation's time."""

    run: str
    seq: int
    gpus: int
    gpu: str
    dp: int
    cp: int
    ep: int
    recompute: bool
    offload: bool
    optimizer_offload: bool
    fsdp: bool
    fits: bool
    usable_gib: float
    peak_gib_per_rank: float
    device_gib: dict[str, float]
    transients_gib: dict[str, float]
    host_gib_per_node: dict[str, float]
    flops_per_token: float
    comm_bytes_per_step: dict[str, float]
    step_s: float
    tokens_per_s_projected: float
    assumptions: dict[str, Any]  # `Assumptions` as resolved, the step time's parts and the rules (plan.json)
    notes: list[str] = field(default_factory=list)
    stage: str = "train"  # "train" (the training step) or "eval" (the evaluator's forward)
    evaluation: EvalTime | None = None  # stage="eval"
    roofline: dict[str, Any] = field(default_factory=dict)  # `plan_time.roofline_summary`: op by op
    optimizer: str = "adamw"  # training's `optimizer` (`genomelm.run.config.OPTIMIZERS`)
    # the range (training): "low" / "high" -> tokens_per_s, step_s (per window) and peak_gib with every rate
    # at its pessimistic / optimistic end (`rates.CASES`) and the expert load at its quantiles; {} otherwise
    range: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def host_gib_total(self) -> float:
        return sum(self.host_gib_per_node.values())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["host_gib_per_node"] = {**self.host_gib_per_node, "total": self.host_gib_total}
        return out
