"""Time per window: FLOPs of the busiest rank / (achieved fraction of the GPU's bf16 peak), plus the
collectives at the link of their group, plus the offload copies over PCIe, added without overlap."""

from __future__ import annotations

from dataclasses import dataclass

from genomelm.model import ModelConfig
from genomelm.train.config import TrainConfig
from genomelm.train.plan_memory import ParameterShare, ScaledTraces
from genomelm.train.plan_types import Assumptions, Layout

# With optimizer_offload the AdamW step runs on the host CPU, one parameter tensor at a time (`foreach=False`:
# FSDP2's DTensors on two meshes, the experts' and the rest's, cannot share a foreach kernel): about seven
# passes over the fp32 parameter, its gradient and the two moments, read and written, ~100 B per parameter,
# at a share of the node's memory bandwidth (a two-socket node's ~200 GB/s over its 8 GPUs). On the GPU the
# same per-tensor loop costs launches only (~10 kernels per parameter tensor, 5 us each: well under 0.1 s).
HOST_ADAMW_BYTES_PER_PARAMETER = 100
HOST_MEMORY_GBS_PER_GPU = 25.0


@dataclass
class StepTime:
    """One window of one rank: its FLOPs, its bytes per collective, and the seconds of each part."""

    rank_flops: float  # FLOPs of one rank (recompute included)
    busiest_flops: float  # of the busiest expert-parallel rank (`imbalance` x the mean routed rows)
    comm: dict[str, float]  # bytes one rank moves, by collective
    compute_s: float
    comm_s: float
    host_s: float  # offload copies over PCIe and, with optimizer offload, the AdamW step on the host

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.host_s


def step_time(
    config: TrainConfig,
    model_config: ModelConfig,
    layout: Layout,
    params: ParameterShare,
    steps: ScaledTraces,
    host_inputs: float,
    a: Assumptions,
) -> StepTime:
    """One window's time on one rank of `layout`; `host_inputs`: the bytes of layer inputs it offloads."""
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
    comm, comm_s = comm_bytes(model_config, layout, params, steps, a)
    compute_s = busiest_flops / (a.tflops * 1e12 * a.mfu)
    host_s = 0.0  # offload copies over PCIe
    if config.memory.offload:  # the layer inputs out and back, per window
        host_s += 2 * host_inputs / (a.pcie_gbs * 1e9)
    if layout.optimizer_offload:  # the fp32 gradients down and the fp32 parameters up, per optimizer step
        host_s += 2 * 4 * params.local / config.optim.grad_accum / (a.pcie_gbs * 1e9)
        # and the AdamW step itself on the host
        adamw_bytes = HOST_ADAMW_BYTES_PER_PARAMETER * params.local / config.optim.grad_accum
        host_s += adamw_bytes / (HOST_MEMORY_GBS_PER_GPU * 1e9)
    return StepTime(rank_flops, busiest_flops, comm, compute_s, comm_s, host_s)


def link_bytes_per_s(a: Assumptions, ranks: int) -> float:
    """Bytes per second of a collective over `ranks` consecutive ranks: NVLink inside a node, else the
    NICs."""
    return (a.nvlink_gbs if ranks <= a.gpus_per_node else a.ib_gbs) * 1e9


def comm_bytes(
    model_config: ModelConfig, layout: Layout, params: ParameterShare, steps: ScaledTraces, a: Assumptions
) -> tuple[dict[str, float], float]:
    """Bytes one rank moves per window (the traced context-parallel collectives scaled by layer, plus the
    computed FSDP, gradient and expert-parallel ones), and their seconds at the link each group runs over."""
    lo, hi, cp, world, ep = steps.lo, steps.hi, layout.cp, layout.world, layout.ep
    out: dict[str, float] = {}
    seconds = 0.0

    def add(name: str, value: float, ranks: int) -> None:
        nonlocal seconds
        out[name] = out.get(name, 0.0) + value
        seconds += value / link_bytes_per_s(a, ranks)

    for i in range(model_config.num_hidden_layers):
        part = f"layers.{steps.rep_of[i]}"
        for kind, size in hi.comm.get(part, {}).items():
            add(f"cp {kind}", steps.line(lo.comm.get(part, {}).get(kind, 0), size), cp)
    for kind, size in hi.comm.get("rest", {}).items():
        if not (kind == "all_reduce" and size > 1024):  # not the packed gradient sum (computed below)
            add(f"cp {kind}", size, cp)
    if layout.sharded:
        edp = world // ep
        gathered = (params.total - params.experts) * (world - 1) / world + params.experts / ep * (
            edp - 1
        ) / edp
        add("fsdp all_gather (bf16, forward + recompute)", 2 * 2 * gathered, world)
        add("fsdp reduce_scatter (fp32 gradients)", 4 * gathered, world)
    elif world > 1:  # every rank's gradients summed (one packed all-reduce; ring: twice the bytes)
        add("gradient all_reduce (fp32)", 2 * 4 * params.local * (world - 1) / world, world)
    if ep > 1:
        moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types)
        rows = steps.tokens * model_config.num_experts_per_tok
        per_layer = rows * model_config.hidden_size * 2 * (ep - 1) / ep
        add(
            "ep all_to_all (dispatch + combine; forward, recompute, backward)",
            per_layer * 2 * 3 * moe_layers * a.imbalance,
            ep,
        )
    return out, seconds
