"""The planner's types: the GPUs it knows, what its projection assumes (from the run's settings and
metrics), a layout of the GPUs and its verdict."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genomelm.parallel.placement import (
    fit_zipf,
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
    imbalance: float = ASSUMED_IMBALANCE
    imbalance_source: str = "assumed (4x the mean)"
    trace_tokens: int = PlanConfig.trace_tokens
    # the run places its experts by load (`expert_placement=balanced`): a logged or modelled load's imbalance
    # is taken after placement, else under the static blocks (and the placement shown beside)
    placed: bool = False
    copies: int = 0  # the placement's copy slots per rank (`expert_copies`)
    # where placed: the static blocks' imbalance (a run places its experts at resume, so it starts on the
    # static blocks: memory is sized for them), and the experts' weights the busiest rank sends and
    # receives for copies per MoE layer pass (`Placement.copy_weights`)
    static_imbalance: float = 0.0
    copy_weights: float = 0.0
    # from a run's expert_load.json (`logged_imbalance`): busiest/mean of the static blocks at each ep, and
    # under a placement by load
    logged_experts: int = 0
    logged_static: dict[int, float] = field(default_factory=dict)
    logged_placed: dict[int, float] = field(default_factory=dict)
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
        imbalance its run's logged load gives there (when that load is of as many experts), else the load
        model's; under the static blocks, or after placement by load where the run places its experts."""
        if self.logged_experts == experts and ep in self.logged_static:
            static, placed = self.logged_static[ep], self.logged_placed[ep]
            traffic = self.logged_copy_weights[ep]
            source = f"measured (expert_load.json, {self._placement_text(ep, static, placed)})"
        elif self.load_model and ep > 1 and (model := assumed_load(experts, ep, self.copies)) is not None:
            exponent, static, placed, traffic = model
            source = (
                f"assumed: a Zipf load (s={exponent:.3f}) whose static blocks give {ASSUMED_IMBALANCE:g}x at "
                f"ep={PUBLISHED_EP}, as published; {self._placement_text(ep, static, placed)}"
            )
        else:
            return self
        if not self.placed:
            return dataclasses.replace(self, imbalance=static, imbalance_source=source)
        return dataclasses.replace(
            self, imbalance=placed, imbalance_source=source, static_imbalance=static, copy_weights=traffic
        )

    @property
    def sized_imbalance(self) -> float:
        """The imbalance memory is sized for: the static blocks' where the run starts on them."""
        return max(self.imbalance, self.static_imbalance)

    def _placement_text(self, ep: int, static: float, placed: float) -> str:
        copies = f" and {self.copies} copy slot(s) per rank" if self.copies else ""
        if self.placed:
            return f"placed by load{copies} at ep={ep}: {placed:.2f}, the static blocks {static:.2f}"
        return f"the static blocks at ep={ep}; placed by load {placed:.2f} with expert_placement=balanced"


@functools.cache
def assumed_load(experts: int, ep: int, copies: int = 0) -> tuple[float, float, float, int] | None:
    """(Zipf exponent, busiest/mean of the static blocks, and placed by load with `copies` copy slots per
    rank, and the copies' weights the busiest rank moves per layer pass) at `ep` for the load model of an
    unmeasured run: experts loaded as 1 / k**s in a fixed random order, s fitted so the static blocks give
    the published ~4x at the published ep=32. None where it does not apply (32 or ep not dividing
    `experts`)."""
    if experts % PUBLISHED_EP or experts % ep:
        return None
    exponent = fit_zipf(experts, PUBLISHED_EP, ASSUMED_IMBALANCE)
    load = zipf_load(experts, exponent)
    static = static_placement(experts, ep).busiest_over_mean(load)
    placed = placement_with_replicas(load, ep, copies)
    return exponent, static, placed.busiest_over_mean(load), placed.copy_weights(experts, ep)


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
    under the static blocks and under a placement by load (with `copies` copy slots per rank), and the
    placement's copies' weights the busiest rank moves per layer pass (mean over the layers), at every
    power-of-two ep dividing the experts (the `logged_*` fields of `Assumptions`)."""
    layers = read_expert_load(path)
    experts = len(next(iter(layers.values()))) if layers else 0
    eps = [2**k for k in range(1, experts.bit_length()) if experts % 2**k == 0]
    logged: dict[str, Any] = {"logged_experts": experts, "logged_static": {}, "logged_placed": {}}
    logged["logged_copy_weights"] = {}
    for ep in eps:
        placed = {layer: placement_with_replicas(load, ep, copies) for layer, load in layers.items()}
        static = dict.fromkeys(layers, static_placement(experts, ep))
        logged["logged_static"][ep] = layers_busiest_over_mean(layers, static)
        logged["logged_placed"][ep] = layers_busiest_over_mean(layers, placed)
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

    @property
    def host_gib_total(self) -> float:
        return sum(self.host_gib_per_node.values())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["host_gib_per_node"] = {**self.host_gib_per_node, "total": self.host_gib_total}
        return out
