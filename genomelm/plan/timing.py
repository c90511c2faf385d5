"""Time per window, op by op (`genomelm.plan.roofline`): every kernel of the traced step at the roofline of
the unit it runs on (each traced layer standing for the layers of its kind; the busiest expert-parallel
rank's grouped GEMMs x `imbalance`), plus the collectives at the link of their group with their ring factor,
plus the offload copies over PCIe; what FSDP2's collectives (and their copies) and the layer-input copies on
side streams leave exposed comes from a per-layer event model of the streams (`layer_works`,
`genomelm.plan.overlap`, `roofline.OVERLAP_RULE`), everything else adds up. The flat estimate (FLOPs at
`mfu` of the bf16 peak) is kept beside it for comparison. For the evaluation (stage=eval): the forward's
kernels and collectives of a window and of its context cut, and the whole before/after evaluation of the
held-out set (`evaluation_time`, `held_out_windows`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genomelm.data import read_manifest
from genomelm.model import ModelConfig
from genomelm.plan import rates, roofline
from genomelm.plan.comm import comm_bytes, copy_exchanges, forward_comm_bytes, fsdp_groups
from genomelm.plan.layouts import Assumptions, EvalTime, Layout
from genomelm.plan.low_precision import expert_peaks, expert_quantisation
from genomelm.plan.memory import ParameterShare, ScaledTraces, reduce_bytes
from genomelm.plan.optimizer_bytes import StateBytes
from genomelm.plan.overlap import LayerWork, simulate
from genomelm.plan.rates import Peaks
from genomelm.run import scoring
from genomelm.run.config import TrainConfig

# With optimizer_offload the AdamW step runs on the host CPU, one parameter tensor at a time (`foreach=False`:
# FSDP2's DTensors on two meshes, the experts' and the rest's, cannot share a foreach kernel): about seven
# passes over the fp32 parameter, its gradient and the two moments, read and written, ~100 B per parameter,
# at the GPU's share of its node's memory bandwidth (`rates.RATES` "host_memory"). On the GPU the same
# per-tensor loop moves the same bytes through HBM (its launches, ~10 per parameter tensor, are well under
# 0.1 s).
HOST_ADAMW_BYTES_PER_PARAMETER = 100
ADAMW_BYTES_PER_PARAMETER = 100
# The low-bit choices (adamw8bit, adamw_bf16) on the GPU: torchao's `single_param_adam` compiled by inductor
# into one kernel per parameter (`genomelm.train.lowbit`), which reads the weight, the gradient and both
# 8-bit moments with their scales and writes the weight and the moments: `StateBytes.fused_update`, ~16 B
# per parameter with fp32 weights, ~10 B with bf16 ones, at the GPU's memory bandwidth (one launch per
# parameter tensor, ~1,000 of them at full size: milliseconds, not counted). On the host (optimizer_offload)
# the update runs eagerly, op by op (`LowBitAdamW(compiled=False)`), and torchao's 8-bit quantiser is a
# branchless binary search over the 256 codes in int64: counted with a dispatch mode over one step of a
# [256, 1024] parameter, 1,558 B per parameter over 130 ops with fp32 weights and 1,648 B over 143 ops with
# bf16 ones (torch's AdamW, counted the same way: 84 B over 8 ops, against the 100 B assumed above), so
# 1,600 and 1,700 B; on one core of the planner's CPU it took 29x (bf16: 32x) AdamW's time, so these are
# the lower end.
HOST_LOWBIT_BYTES_PER_PARAMETER = {"adamw8bit": 1600, "adamw_bf16": 1700}
# With optimizer_offload and gradient accumulation, FSDP2 adds each micro-batch's reduced fp32 gradient shard
# to the one already on the host inside the backward, after the first: a blocking device-to-host copy (4 B
# per parameter over PCIe) and an add on the host CPU (read both, write one: 12 B) that nothing overlaps
# (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, `foreach_reduce`'s offload branch);
# half of both where the gradients are bf16 (adamw_bf16: the weights' dtype).
HOST_ACCUMULATE_BYTES_PER_PARAMETER = 12
# The expert exchange's copies on the receiving rank, per MoE layer and pass: its received rows to the order
# of its local experts and their outputs back to arrival order (`parallel/expert.py`), each read and written
# once; not in the trace, which runs the experts on one rank (ep=1).
EXCHANGE_COPIES = 2
MFU_FORMULA = (
    "MFU = model FLOPs per token x tokens/s / (GPUs x dense bf16 peak), model FLOPs per token = the traced "
    "forward + backward FLOPs of the mean rank's window without recompute / its tokens (PaLM appendix B; "
    "Megatron, torchtitan); HFU the same with the recompute's FLOPs; the busiest rank sets the step time"
)
# Held-out sets sized without their prepared folder: genome -> (held-out record (configs/data/<genome>.yaml),
# its length, its bases other than N; GRCh38 chr22, whose N are mostly the short arm's first ~10.5 Mb).
HELD_OUT_ESTIMATES = {"hg38": ("chr22", 50_818_468, 39_159_782)}
EVAL_MODELS = 2  # the evaluation scores the model before training and after
TOP_CLASSES = 10  # op classes listed in the plan


@dataclass
class StepTime:
    """One window of one rank: its FLOPs, its bytes per collective, and the seconds of each part (the compute
    and the op classes: the busiest expert-parallel rank's, which the step waits for)."""

    rank_flops: float  # FLOPs of one rank (recompute included)
    busiest_flops: float  # of the busiest expert-parallel rank (`imbalance` x the mean routed rows)
    comm: dict[str, float]  # bytes one rank moves, by collective
    compute_s: float  # the busiest rank's kernels at their roofline
    comm_s: float  # collectives that block the compute
    host_s: float  # what adds up on the host side: optimizer offload's copies, accumulation and AdamW step
    overlapped_s: float = 0.0  # side-stream work (FSDP2's collectives, layer-input offload copies)
    model_flops: float = 0.0  # the mean rank's FLOPs less its recompute (MFU's numerator)
    executed_flops: float = 0.0  # the mean rank's FLOPs, recompute included (HFU's numerator)
    flat_compute_s: float = 0.0  # busiest_flops at `mfu` of the bf16 peak (the flat estimate)
    top: list[dict[str, Any]] = field(default_factory=list)  # the costliest op classes, mean rank
    busiest_top: list[dict[str, Any]] = field(default_factory=list)  # the same at the busiest EP rank
    mean_compute_s: float = 0.0  # the mean rank's kernels
    by_source: list[dict[str, Any]] = field(default_factory=list)  # the busiest rank's kernels by source file
    host_parts: dict[str, float] = field(default_factory=dict)  # `host_s` by part
    # what the per-layer event model (`overlap.simulate`) adds to the compute, by part; empty: the aggregate
    # rule (the side-stream work less the compute, the evaluator's forward)
    exposed: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        """The side-stream work the compute does not hide, and what waiting for it adds."""
        if self.exposed:
            return sum(self.exposed.values())
        return max(0.0, self.overlapped_s - self.compute_s)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.exposed_s + self.host_s


def device_peaks(a: Assumptions, gpu: str) -> Peaks:
    """`gpu`'s attainable rates (`rates.RATES`) with the links and the datasheet bf16 peak as `a` gives
    them."""
    p = rates.peaks(gpu, a.nvlink_gbs, a.nic_gbs, a.nics_per_node, a.gpus_per_node, a.pcie_gbs, a.case)
    return dataclasses.replace(p, peak_bf16=a.tflops * 1e12 or p.peak_bf16)


@dataclass
class KernelTime:
    """The traced kernels of one window at their roofline: the busiest expert-parallel rank's seconds (what
    the step waits for), the mean rank's, the mean rank's FLOPs with and without recompute, the costliest op
    classes of each, and the busiest rank's seconds by source file."""

    busiest_s: float
    mean_s: float
    model_flops: float
    executed_flops: float
    top: list[dict[str, Any]]
    busiest_top: list[dict[str, Any]]
    by_source: list[dict[str, Any]]


def exchange_copies(
    model_config: ModelConfig, layout: Layout, tokens: int, passes: int, p: Peaks, scale: float
) -> list[roofline.CostedClass]:
    """The expert exchange's copies on a receiving rank (`EXCHANGE_COPIES` per MoE layer and pass, bf16 rows
    read and written), its rows `scale` x the mean (tokens x top-k); none without expert parallelism."""
    if layout.ep == 1:
        return []
    moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types)
    count = EXCHANGE_COPIES * passes * moe_layers
    rows = tokens * model_config.num_experts_per_tok * scale
    moved = 2 * 2 * rows * model_config.hidden_size * count  # read + write, 2 B each
    seconds = moved / p.memory + count * p.launch_s
    where = "genomelm/parallel/expert.py (received rows to expert order and back; not traced, counted)"
    key = f"aten.index bf16 @ {where}"
    return [
        roofline.CostedClass(
            key, "aten.index", "memory", where, count, 0.0, moved, seconds, "memory", 0.0, "memory"
        )
    ]


def planned_routes(
    model_config: ModelConfig, layout: Layout, tokens: int, chunk_tokens: int, p: Peaks, routings: int = 1
) -> list[roofline.CostedClass]:
    """Under expert parallelism the router runs `routings` more times per MoE layer and window, before the
    layer's chunks (`plan_expert_chunks`: every chunk routed without autograd, so that one collective
    exchanges all their split sizes, and with ep_overlap again in the layer's recompute, to start each
    chunk's dispatch ahead): one fp32 GEMM [chunk, D] x [D, E] per chunk of the rank's own tokens (no
    imbalance: routing precedes the exchange), its bf16 input cast to fp32 and its logits written. Its
    sigmoid, bias and top-k (a few small kernels per chunk) are left out. None at ep 1. FLOPs executed, not
    model FLOPs (the model's own routing is traced)."""
    if layout.ep == 1:
        return []
    moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types) * routings
    chunks = math.ceil(tokens / chunk_tokens)
    count = chunks * moe_layers
    width, experts = model_config.hidden_size, model_config.n_routed_experts
    flops = 2.0 * tokens * width * experts * moe_layers
    # per layer: the bf16 rows read and cast (2 + 4 B), the fp32 rows read, the router's weights once per
    # chunk, the fp32 logits written
    moved = moe_layers * (tokens * width * 10 + chunks * experts * width * 4 + tokens * experts * 4)
    seconds, bound = roofline.kernels_seconds("gemm_fp32", "fp32", flops / count, moved / count, count, p)
    where = "genomelm/parallel/expert.py (the router again before a layer's chunks; not traced, counted)"
    rate = p.resolved("gemm_fp32", "fp32") if bound == "compute" else bound
    return [
        roofline.CostedClass(
            f"aten.mm fp32 @ {where}",
            "aten.mm",
            "fp32",
            where,
            count,
            flops,
            moved,
            seconds,
            bound,
            0.0,
            rate,
        )
    ]


def memoised(steps: ScaledTraces, key: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()` memoised on `steps` under `key` (what it reads besides `steps`): the layouts of a search
    that share its traces and differ in offload, optimizer offload or the optimizer read the same kernels at
    the same rates. The value is read, not changed, by the callers."""
    value = steps.projections.get(key)
    if value is None:
        value = steps.projections[key] = compute()
    return value


def rates_key(p: Peaks) -> tuple:
    """`p`'s values, hashable."""
    values = (getattr(p, f.name) for f in dataclasses.fields(p))
    return tuple(tuple(v.items()) if isinstance(v, dict) else v for v in values)


def project(
    steps: ScaledTraces, times: dict[str, float], p: Peaks, rows: float, weights: float
) -> list[roofline.CostedClass]:
    """`roofline.project` of `steps` at its tokens (`memoised`)."""
    return memoised(
        steps,
        ("classes", tuple(times.items()), rates_key(p), rows, weights),
        lambda: roofline.project(
            steps.lo.ops, steps.hi.ops, steps.t1, steps.t2, steps.tokens, times, p, rows, weights
        ),
    )


def kernel_time(
    model_config: ModelConfig,
    layout: Layout,
    steps: ScaledTraces,
    a: Assumptions,
    gpu: str,
    chunk_tokens: int,
    passes: int = 3,
    routings: int = 1,
    precision: str = "bf16",
    recompute: bool = True,
) -> KernelTime:
    """The traced kernels of one window at the rank's tokens, every layer by its kind's (the update phase
    apart: it is costed from the parameters), with the expert exchange's copies (`passes` of them: forward,
    recompute, backward) and the router run ahead of the chunks of `chunk_tokens` `routings` times
    (`planned_routes`); the routed experts' GEMMs at `precision` (`genomelm.plan.low_precision`; its
    quantisation in the recompute with `recompute`)."""
    p = expert_peaks(device_peaks(a, gpu), model_config, layout, precision, steps.tokens, chunk_tokens)
    times: dict[str, float] = {"rest": 1.0}
    for i in range(model_config.num_hidden_layers):
        part = f"layers.{steps.rep_of[i]}"
        times[part] = times.get(part, 0.0) + 1.0
    # the experts' weights cast to the compute dtype: none where FSDP2 gathers them in bf16, else E/ep of them
    weights = 0.0 if layout.sharded else 1 / layout.ep
    scale = a.imbalance if layout.ep > 1 else 1.0

    def projected(rows: float) -> list[roofline.CostedClass]:
        traced = project(steps, times, p, rows, weights)
        copies = exchange_copies(model_config, layout, steps.tokens, passes, p, rows)
        routes = planned_routes(model_config, layout, steps.tokens, chunk_tokens, p, routings)
        quantised = expert_quantisation(
            model_config, layout, precision, steps.tokens, chunk_tokens, p, rows, recompute
        )
        return sorted(traced + copies + routes + quantised, key=lambda c: -c.seconds)

    mean = projected(1.0)
    busiest = projected(scale) if scale != 1 else mean
    mean_s, busiest_s = sum(c.seconds for c in mean), sum(c.seconds for c in busiest)
    return KernelTime(
        busiest_s,
        mean_s,
        sum(c.model_flops for c in mean),
        sum(c.flops for c in mean),
        roofline.top_classes(mean, mean_s, p, TOP_CLASSES),
        roofline.top_classes(busiest, busiest_s, p, TOP_CLASSES),
        roofline.by_source(busiest),
    )


def step_time(
    config: TrainConfig,
    model_config: ModelConfig,
    layout: Layout,
    params: ParameterShare,
    steps: ScaledTraces,
    host_inputs: float,
    a: Assumptions,
    state: StateBytes,
) -> StepTime:
    """One window's time on one rank of `layout`; `host_inputs`: the bytes of layer inputs it offloads;
    `state`: its weights, gradients and optimizer state (the update's bytes)."""
    chunk_tokens, precision = config.model_options.moe_chunk_tokens, config.model_options.expert_precision
    p = expert_peaks(
        device_peaks(a, config.plan.gpu), model_config, layout, precision, steps.tokens, chunk_tokens
    )
    rank_flops, busiest_flops = _flops(model_config, layout, steps, a)
    reduced = reduce_bytes(config)
    comm, comm_s, side = comm_bytes(
        model_config,
        layout,
        params,
        steps,
        a,
        p,
        config.parallel.ep_overlap,
        copy_exchanges(config, layout),
        reduced,
    )
    routings = 2 if config.parallel.ep_overlap else 1  # the forward's, and the recompute's to start ahead
    kernels = kernel_time(
        model_config,
        layout,
        steps,
        a,
        config.plan.gpu,
        chunk_tokens,
        3,
        routings,
        precision,
        config.memory.recompute,
    )
    host: dict[str, float] = {}
    offloaded = host_inputs if config.memory.offload else 0.0
    works, rest_s, moe_s = layer_works(
        model_config,
        layout,
        params,
        steps,
        a,
        p,
        offloaded,
        chunk_tokens,
        routings,
        reduced,
        precision,
        config.memory.recompute,
    )
    timeline = simulate(
        works, between=rest_s, forward_prefetch=config.parallel.fsdp_prefetch, comm_sm_share=p.comm_sm_share
    )
    exposed = dict(timeline.exposed)
    # the expert exchanges started ahead run on NVLink (and NICs past a node) beside the MoE work
    ahead = sum(v for k, v in side.items() if k.startswith("ep "))
    exposed["expert exchanges started ahead, past the MoE work"] = max(0.0, ahead - moe_s)
    overlapped_s = sum(side.values()) + (2 * host_inputs / p.links.pcie if config.memory.offload else 0.0)
    compute_s, mean_s = timeline.compute_s, kernels.mean_s
    accum = config.optim.grad_accum
    if layout.optimizer_offload:
        host = host_update(config, params, state, a, p)
    else:  # the update on the GPU, per window
        update_s = update_bytes(params, state) / accum / p.memory
        compute_s, mean_s = compute_s + update_s, mean_s + update_s
    time = _step_time(
        rank_flops,
        busiest_flops,
        comm,
        comm_s,
        sum(host.values()),
        overlapped_s,
        kernels,
        a,
        compute_s,
        mean_s,
    )
    time.host_parts = host
    time.exposed = exposed
    return time


def layer_works(
    model_config: ModelConfig,
    layout: Layout,
    params: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
    p: Peaks,
    host_inputs: float,
    chunk_tokens: int,
    routings: int,
    reduced: int = 4,
    precision: str = "bf16",
    passes_recompute: bool = True,
) -> tuple[list[LayerWork], float, float]:
    """Each decoder layer's work in a window for the event model (`LayerWork`), the rest's compute
    (embedding, head, loss; forward and backward) and the MoE work of every pass (seconds), at the busiest
    expert-parallel rank. A layer's kernels by pass: the backward's classes, the recompute's share of the
    others' count, the forward's the rest (of it the MoE's, after its host sync, the tail); the exchange's
    copies one third per pass, the routing ahead in the forward (and the recompute's), and at a low
    `precision` torchao's quantisation by pass (`expert_quantisation`, the recompute's with
    `passes_recompute`; `p` already at that precision's grouped GEMM rate). FSDP2 per layer and pass: the
    all-gather of its parameters (bf16) and of its experts over their groups (`fsdp_groups`, the NICs
    shared), its copy-out (read and write the gathered bf16) on the compute stream; after the backward the
    reduce-scatter (in `reduced` bytes per value: fp32 4, bf16 2) behind its copy-in and cast (bf16 read, the
    reduce dtype written). `host_inputs`: the bytes of layer inputs offloaded (0: none), back over PCIe in
    the backward, beside the GPU's share of its node's NIC traffic (GPU-direct through the same switch
    port). Left out: the all-gathers' copy-in (a rank's own shard, 1/world of a layer) and the root unit's
    gather (embedding, norm, head)."""
    scale = a.imbalance if layout.ep > 1 else 1.0
    weights = 0.0 if layout.sharded else 1 / layout.ep
    n = model_config.num_hidden_layers
    sparse = [t == "sparse" for t in model_config.mlp_layer_types]
    moe_layers = max(sum(sparse), 1)
    lo, hi = steps.lo.ops, steps.hi.ops

    def passes(part: str) -> tuple[float, float, float, float, float]:
        return memoised(steps, ("passes", part, rates_key(p), scale, weights), lambda: summed(part))

    def summed(part: str) -> tuple[float, float, float, float, float]:
        classes = roofline.project(lo, hi, steps.t1, steps.t2, steps.tokens, {part: 1.0}, p, scale, weights)
        backward = sum(c.seconds for c in classes if c.backward)
        recompute = sum(c.recompute_seconds for c in classes if not c.backward)
        forward = sum(c.seconds for c in classes if not c.backward) - recompute
        tail = sum(c.seconds - c.recompute_seconds for c in classes if c.moe and not c.backward)
        moe = sum(c.seconds for c in classes if c.moe)
        return forward, recompute, backward, tail, moe

    kinds = {rep: passes(f"layers.{rep}") for rep in set(steps.rep_of.values())}
    copies = sum(c.seconds for c in exchange_copies(model_config, layout, steps.tokens, 3, p, scale))
    routes = sum(
        c.seconds for c in planned_routes(model_config, layout, steps.tokens, chunk_tokens, p, routings)
    )
    copy_s, route_s = copies / 3 / moe_layers, routes / routings / moe_layers
    quantised = expert_quantisation(
        model_config, layout, precision, steps.tokens, chunk_tokens, p, scale, recompute=passes_recompute
    )
    quant_f, quant_r, quant_b = (c.seconds / moe_layers for c in quantised) if quantised else (0.0,) * 3
    experts = params.experts / moe_layers
    links = p.links
    works, moe_s = [], 0.0
    for i in range(n):
        forward, recompute, backward, tail, moe = kinds[steps.rep_of[i]]
        layer_experts = experts if sparse[i] else 0.0
        gather = reduce = copy_out = nic = 0.0
        if layout.sharded:
            rest = params.numel[f"layers.{i}"] - layer_experts
            for moved, ranks, sharing in fsdp_groups(layout, rest, layer_experts, links.gpus_per_node):
                gather += links.seconds("ring", 2 * moved, ranks, sharing)
                reduce += links.seconds("ring", reduced * moved, ranks, sharing)
                if ranks > links.gpus_per_node:  # what the node's NICs carry, per GPU port
                    nic += (2 + reduced) * moved * sharing / links.gpus_per_node
            unsharded = rest + layer_experts / layout.ep
            copy_out = 2 * 2 * unsharded / p.memory
            reduce += (2 + reduced) * unsharded / p.memory
        if sparse[i]:
            forward, recompute, backward = forward + quant_f, recompute + quant_r, backward + quant_b
            tail += quant_f
            moe += quant_f + quant_r + quant_b
        if sparse[i] and layout.ep > 1:
            forward, recompute, backward = forward + copy_s + route_s, recompute + copy_s, backward + copy_s
            recompute += route_s if routings > 1 else 0.0
            tail += copy_s
        moe_s += moe + 3 * copy_s if sparse[i] and layout.ep > 1 else 0.0
        works.append(
            LayerWork(
                forward=forward,
                recompute=recompute,
                backward=backward,
                tail=tail,
                syncs=sparse[i] and layout.ep > 1,
                gather=gather,
                copy_out=copy_out,
                reduce=reduce,
                host_in=(host_inputs / n + nic) / links.pcie if host_inputs else 0.0,
            )
        )
    rest_s = memoised(
        steps,
        ("rest", rates_key(p), scale, weights),
        lambda: sum(
            c.seconds
            for c in roofline.project(
                lo, hi, steps.t1, steps.t2, steps.tokens, {"rest": 1.0}, p, scale, weights
            )
        ),
    )
    return works, rest_s, moe_s


def update_bytes(params: ParameterShare, state: StateBytes) -> float:
    """Bytes one rank's optimizer update moves through the GPU's memory: AdamW's per-tensor loop
    (`ADAMW_BYTES_PER_PARAMETER`), or the low-bit choices' fused kernel per parameter."""
    if state.optimizer == "adamw":
        return ADAMW_BYTES_PER_PARAMETER * params.local
    return state.fused_update


def host_update(
    config: TrainConfig, params: ParameterShare, state: StateBytes, a: Assumptions, p: Peaks
) -> dict[str, float]:
    """Seconds per window of the host work optimizer offload adds, by part: the copies once per optimizer
    step, the gradient accumulation on the host, and the update on the host CPU (AdamW's, or torchao's
    eager low-bit update: `HOST_LOWBIT_BYTES_PER_PARAMETER`)."""
    accum, pcie = config.optim.grad_accum, p.links.pcie
    host_bandwidth = rates.rate("host_memory").on(config.plan.gpu, a.case) / a.gpus_per_node
    # the gradients down and the parameters up, once per optimizer step, in the weights' dtype
    copies = state.weights + state.gradients
    grad_bytes = state.gradients / max(state.values, 1.0)  # per parameter: 4, or ~2 for bf16 weights
    name = "AdamW step on the host" if state.optimizer == "adamw" else f"{state.optimizer} step on the host"
    per_parameter = HOST_LOWBIT_BYTES_PER_PARAMETER.get(state.optimizer, HOST_ADAMW_BYTES_PER_PARAMETER)
    return {
        "optimizer offload copies": copies / accum / pcie,
        # every micro-batch after the first: its gradient added to the host's inside the backward
        "gradient accumulation on the host": (
            (accum - 1)
            / accum
            * params.local
            * (grad_bytes / pcie + HOST_ACCUMULATE_BYTES_PER_PARAMETER * grad_bytes / 4 / host_bandwidth)
        ),
        name: per_parameter * params.local / accum / host_bandwidth,
    }


def forward_time(
    model_config: ModelConfig,
    layout: Layout,
    stored: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
    stored_in_bf16: bool,
    gpu: str,
    chunk_tokens: int,
    overlap: bool,
) -> StepTime:
    """The evaluator's forward of the traced window on one rank of `layout`: its kernels at their roofline
    plus its collectives (`forward_comm_bytes`; FSDP2's gathers overlapped, and with `overlap` the expert
    exchanges); `stored`: the parameters' bytes as stored (bf16, with the fp32-declared ones fp32, when
    `stored_in_bf16`); MoE chunks of `chunk_tokens`. No host copies."""
    rank_flops, busiest_flops = _flops(model_config, layout, steps, a)
    p = device_peaks(a, gpu)
    comm, comm_s, side = forward_comm_bytes(
        model_config, layout, stored, steps, a, p, stored_in_bf16, overlap
    )
    kernels = kernel_time(model_config, layout, steps, a, gpu, chunk_tokens, passes=1)
    return _step_time(rank_flops, busiest_flops, comm, comm_s, 0.0, sum(side.values()), kernels, a)


def _step_time(
    rank_flops: float,
    busiest_flops: float,
    comm: dict[str, float],
    comm_s: float,
    host_s: float,
    overlapped_s: float,
    kernels: KernelTime,
    a: Assumptions,
    compute_s: float | None = None,
    mean_compute_s: float | None = None,
) -> StepTime:
    """A `StepTime` from its parts; `compute_s` / `mean_compute_s`: the kernels' seconds with what the step
    adds on the device (the AdamW step), else the kernels' own."""
    return StepTime(
        rank_flops=rank_flops,
        busiest_flops=busiest_flops,
        comm=comm,
        compute_s=kernels.busiest_s if compute_s is None else compute_s,
        comm_s=comm_s,
        host_s=host_s,
        overlapped_s=overlapped_s,
        model_flops=kernels.model_flops,
        executed_flops=kernels.executed_flops,
        flat_compute_s=busiest_flops / (a.tflops * 1e12 * a.mfu),
        top=kernels.top,
        busiest_top=kernels.busiest_top,
        mean_compute_s=kernels.mean_s if mean_compute_s is None else mean_compute_s,
        by_source=kernels.by_source,
    )


def _flops(
    model_config: ModelConfig, layout: Layout, steps: ScaledTraces, a: Assumptions
) -> tuple[float, float]:
    """FLOPs of one rank at `steps.tokens` (a*t + b*t^2 through the traces, every layer by its kind's), and
    of the busiest expert-parallel rank (`imbalance` x the mean rows through its routed experts)."""
    lo, hi, rep_of = steps.lo, steps.hi, steps.rep_of
    layers = range(model_config.num_hidden_layers)
    sparse = [i for i in layers if model_config.mlp_layer_types[i] == "sparse"]
    flops = {k: steps.quadratic(lo.flops[k], hi.flops[k]) for k in hi.flops}
    rank_flops = flops["rest"] + sum(flops[f"layers.{rep_of[i]}"] for i in layers)
    expert_flops = sum(
        steps.line(
            lo.expert_flops.get(f"layers.{rep_of[i]}", 0), hi.expert_flops.get(f"layers.{rep_of[i]}", 0)
        )
        for i in sparse
    )
    busiest_flops = rank_flops + (a.imbalance - 1) * expert_flops if layout.ep > 1 else rank_flops
    return rank_flops, busiest_flops


def roofline_summary(time: StepTime, layout: Layout, seq: int, a: Assumptions, gpu: str) -> dict[str, Any]:
    """plan.json's "roofline": the window's seconds by part, tokens/s, MFU and HFU (`MFU_FORMULA`), the flat
    estimate beside, the top op classes (mean and busiest expert-parallel rank) with the rates they were
    costed at, and the rates table."""
    p = device_peaks(a, gpu)
    step = max(time.step_s, 1e-12)
    flat_step = time.flat_compute_s + time.comm_s + time.exposed_s + time.host_s
    tokens = seq // layout.cp
    return {
        "step_s": time.step_s,
        "tokens_per_s": layout.dp * seq / step,
        "mfu": time.model_flops / step / p.peak_bf16,
        "hfu": time.executed_flops / step / p.peak_bf16,
        "model_flops_per_token": time.model_flops / tokens,
        "executed_flops_per_token": time.executed_flops / tokens,
        "mfu_formula": MFU_FORMULA,
        "peak_bf16": p.peak_bf16,
        "compute_s": time.compute_s,
        "mean_compute_s": time.mean_compute_s,
        "comm_s": time.comm_s,
        "overlapped_s": time.overlapped_s,
        "exposed_overlap_s": time.exposed_s,
        "exposed_parts": time.exposed,
        "host_s": time.host_s,
        "host_parts": time.host_parts,
        "model_flops": time.model_flops,
        "flat_compute_s": time.flat_compute_s,
        "flat_tokens_per_s": layout.dp * seq / max(flat_step, 1e-12),
        "top": [row | {"share": row["seconds"] / step} for row in time.top],  # share of the window's time
        "busiest_top": [row | {"share": row["seconds"] / step} for row in time.busiest_top],
        "by_source": [row | {"share": row["seconds"] / step} for row in time.by_source],
        "rates": [dataclasses.asdict(r) for r in rates.RATES],
        "collectives": rates.COLLECTIVE_FACTORS | {"source": rates.COLLECTIVE_SOURCE},
        "overlap": roofline.OVERLAP_RULE,
    }


def context_cut_tokens(config: TrainConfig) -> int:
    """Tokens of the run's context-cut forward (`genomelm.run.scoring.context_cut_tokens`; 0 where the
    evaluator skips it)."""
    return scoring.context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut)


def held_out_windows(config: TrainConfig) -> tuple[int | None, str]:
    """Held-out windows the evaluation scores per model, and where the count came from: the manifests of the
    folders it reads (`heldout`, else the run's data folder), else for the run's own folder an estimate from
    the genome (`HELD_OUT_ESTIMATES`: non-N bases / seq, rounded up; the data stage drops windows over
    `max_n_fraction` N), else None; `eval_windows` caps each folder's count."""
    folders = [Path(f.strip()) for f in config.eval.heldout.split(",")] if config.eval.heldout else []
    folders = folders or [config.data_dir]
    cap = config.eval.eval_windows

    def capped(n: int) -> int:
        return min(n, cap) if cap > 0 else n

    manifests = {folder: read_manifest(folder) for folder in folders}
    missing = [str(folder) for folder, manifest in manifests.items() if manifest is None]
    capping = f", at most eval_windows={cap} each" if cap > 0 else ""
    if not missing:
        counts = [int(m["splits"]["heldout"]["stats"]["windows"]) for m in manifests.values() if m]
        where = ", ".join(f"{folder / 'manifest.json'} ({n:,})" for folder, n in zip(folders, counts))
        return sum(capped(n) for n in counts), f"the held-out split of {where}{capping}"
    if not config.eval.heldout and config.genome in HELD_OUT_ESTIMATES:
        record, length, bases = HELD_OUT_ESTIMATES[config.genome]
        estimate = math.ceil(bases / config.seq_len)
        return capped(estimate), (
            f"estimated: {config.genome} {record}, {bases:,} of its {length:,} bases not N, / "
            f"{config.seq_len:,} per window, rounded up{capping} (no prepared folder {missing[0]})"
        )
    if cap > 0:
        return cap, f"eval_windows={cap} (at most: no prepared folder {', '.join(missing)})"
    return None, (
        f"unknown: no prepared folder {', '.join(missing)} and no estimate for genome {config.genome} "
        "(prepare the data, or give eval_windows=N)"
    )


def evaluation_time(
    config: TrainConfig, layout: Layout, window: StepTime, cut: StepTime | None, cut_tokens: int
) -> EvalTime:
    """The evaluation's time: each dp replica scores its share of the held-out windows (the busiest,
    ceil(windows / dp)), each window in full and, with the context cut, once more over `cut_tokens`; both
    models (`EVAL_MODELS`)."""
    windows, source = held_out_windows(config)
    cut_s = cut.step_s if cut is not None else 0.0
    per_replica = math.ceil(windows / layout.dp) if windows is not None else None
    total = EVAL_MODELS * per_replica * (window.step_s + cut_s) if per_replica is not None else None
    return EvalTime(window.step_s, cut_tokens, cut_s, windows, source, per_replica, EVAL_MODELS, total)
