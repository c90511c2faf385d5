"""`genomelm plan`: whether a run fits and how fast it goes, measured from one traced step of the real code.

`make_plan(config)` traces one rank's training step (`genomelm.train.plan_trace.trace_step`: the trainer's
`window_loss`, `LayerRunner`, context parallelism and AdamW on fake tensors) over one decoder layer of each kind
at the real widths, then scales by the layer counts:
- activations: the traced forward/backward peak + what each untraced layer leaves live until its backward
  (measured per kind: its saved input, and anything else the layer keeps);
- when the rank's tokens exceed `trace_tokens`, the step is traced at trace_tokens/2 and trace_tokens and the
  bytes are extrapolated linearly in tokens (what a layer keeps is linear in the rank's tokens), the transients of
  the chunked modules (feed-forward: moe_chunk_tokens, loss head: loss_chunk_tokens) only up to their chunk, the
  FLOPs as a*t + b*t^2 (the indexer scores every earlier pool);
- parameters, gradients, AdamW state, FSDP2's gathered layers, expert parallelism, optimizer offload and
  offload=false are computed from the model's parameter count and the traced layer inputs (`SHARDING_RULE`,
  `MOE_RULE`, `OFFLOAD_RULE`, written into plan.json): one pair of traces per cp serves every layout.
Time: FLOPs of the busiest rank / (achieved fraction of the GPU's bf16 peak) plus the collectives at the link of
their group plus the offload copies over PCIe (no overlap assumed), all printed and settable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.train.checkpoints import is_preset
from genomelm.train.config import TrainConfig
from genomelm.train.memory import LayerRunner
from genomelm.train.plan_trace import StepTrace, layer_kind, reduced_layers, trace_step

GIB = 2**30
GPUS = {  # usable device memory (GiB), dense bf16 peak (TFLOP/s), NVLink per GPU per direction (GB/s)
    "b200": (178.0, 2250.0, 900.0),
    "h200": (139.0, 989.0, 450.0),
}
PUBLISHED = {  # the reference recipe on 64 B200 (Megatron TP8 x CP2 x DP4, EP32 x ETP2, full recompute, offload)
    "1M": {"peak_gib_per_gpu": 144.5, "tokens_per_s": 13700},
    "256k": {"tokens_per_s": 24900},
}
ASSUMPTION_KEYS = ("mfu", "nvlink_gbs", "ib_gbs", "pcie_gbs", "gpus_per_node", "host_gib", "imbalance", "trace_tokens",
                   "tflops")


class PlanError(RuntimeError):
    """The run does not fit the GPUs it is planned for."""


@dataclass
class Assumptions:
    """What the projection assumes; each settable as key=value on `genomelm plan`."""

    mfu: float = 0.35  # achieved fraction of the GPU's dense bf16 peak
    tflops: float = 0.0  # the GPU's dense bf16 peak, TFLOP/s (0: from `gpu`)
    nvlink_gbs: float = 0.0  # per GPU per direction inside a node, GB/s (0: from `gpu`)
    ib_gbs: float = 50.0  # per GPU per direction between nodes (400 Gb/s NICs), GB/s
    pcie_gbs: float = 50.0  # per GPU per direction to host memory (offload copies), GB/s
    gpus_per_node: int = 8
    host_gib: float = 2048.0  # host memory per node (DGX B200 / H200: 2 TiB); a layout needing more does not fit
    imbalance: float = 4.0  # busiest expert-parallel rank's tokens over the mean (from the run's metrics if any)
    imbalance_source: str = "assumed (4x the mean)"
    trace_tokens: int = 2048  # most tokens per rank traced; more are extrapolated

    def resolved(self, gpu: str) -> Assumptions:
        if gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, not {gpu!r}")
        _, tflops, nvlink = GPUS[gpu]
        return dataclasses.replace(self, tflops=self.tflops or tflops, nvlink_gbs=self.nvlink_gbs or nvlink)


@dataclass
class Plan:
    """One layout's verdict (bytes per rank, per node; FLOPs; projected speed)."""

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
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def host_gib_total(self) -> float:
        return sum(self.host_gib_per_node.values())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["host_gib_per_node"] = {**self.host_gib_per_node, "total": self.host_gib_total}
        return out


def resolve_model_config(config: TrainConfig) -> ModelConfig:
    """The run's architecture; without a model set, the GLM-5.3-Flash architecture the hg38 configs train."""
    if not config.model:
        return ModelConfig.preset("glm-5.3-flash")
    if is_preset(config.model):
        return ModelConfig.preset(config.model)
    if not Path(config.model).exists():
        raise FileNotFoundError(f"model {config.model!r} is neither a preset in configs/model/ nor a folder")
    return ModelConfig.from_file(config.model)


def model_numel(model_config: ModelConfig) -> dict[str, int]:
    """Parameters per decoder layer ("layers.<i>") and of the rest, counted on the meta device; "experts": the
    routed experts' share of the total."""
    model = GlmForCausalLM.from_config(model_config, device="meta")
    out = {f"layers.{i}": sum(p.numel() for p in layer.parameters()) for i, layer in enumerate(model.layers)}
    out["rest"] = sum(p.numel() for p in model.parameters()) - sum(out.values())
    out["experts"] = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return out


def measured_imbalance(config: TrainConfig) -> float | None:
    """The largest router/*/max_over_mean in runs/<run>/metrics.jsonl, or None without a run."""
    path = config.run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    ratios = []
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        ratios += [v for k, v in record.items() if k.startswith("router/") and k.endswith("/max_over_mean")]
    return max(ratios) if ratios else None


def _extrapolate(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """The line through (t1, a) and (t2, b) at t."""
    return b if t == t2 or t1 == t2 else b + (b - a) * (t - t2) / (t2 - t1)


def _quadratic(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """c1*t + c2*t^2 through (t1, a) and (t2, b), at t."""
    if t == t2:
        return b
    c2 = (b / t2 - a / t1) / (t2 - t1)
    c1 = a / t1 - c2 * t1
    return c1 * t + c2 * t * t


SHARDING_RULE = (
    "bytes per rank from the model's parameter count (meta device), W = dp*cp ranks: with FSDP2 (fsdp=true, W > 1) "
    "every parameter, its fp32 gradient and its AdamW state (2 x fp32) are sharded over all W ranks; the routed "
    "experts are split over ep ranks (E/ep each) and sharded again over the W/ep ranks holding the same experts, so "
    "each rank holds (all parameters) / W x (4 + 4 + 8) B; FSDP gathers one decoder layer in bf16 while it "
    "prefetches the next (2 x 2 B per parameter of the largest layer, its experts / ep) and reduce-scatters its "
    "gradient from a bf16 + fp32 copy (6 B); without FSDP each rank holds every parameter (experts / ep) x 16 B; "
    "optimizer_offload=true keeps the fp32 parameters, gradients and AdamW state in pinned host memory "
    "(FSDP2 CPUOffloadPolicy), leaving the gathered bf16 layers on the GPU"
)
MOE_RULE = (
    "expert parallelism: the busiest rank receives `imbalance` x the mean routed rows (its expert FLOPs and its "
    "all-to-all bytes scale by it); with FSDP or EP the MoE transient is the busiest rank's rows of one "
    "moe_chunk_tokens chunk: rows x (2 hidden + 3 moe_intermediate) x 2 B (the dispatched rows, gate/up, SwiGLU and "
    "output in bf16) x 2 (their gradients), the expert weights' bf16 copies and gradients being the FSDP buffers; "
    "all-to-all bytes: tokens x top-k x hidden x 2 B each way (dispatch, combine) per MoE layer, in the forward, "
    "the recompute and the backward"
)
OFFLOAD_RULE = (
    "traced with offload=true (with recompute, offload moves only each layer's saved input to the host); "
    "offload=false adds those bytes back to the device"
)


class _Traces:
    """Traces at one or two token counts per context-parallel size, cached across layouts: dp, ep, FSDP and
    optimizer offload change bytes in known proportion (computed), and offload only where the saved layer inputs
    live (with recompute), so one pair of traces per cp serves every layout with that cp."""

    def __init__(self) -> None:
        self.cache: dict[tuple, StepTrace] = {}

    @staticmethod
    def traced_run(run: TrainConfig) -> TrainConfig:
        return dataclasses.replace(run, offload=True) if run.recompute else run

    def _key(self, run: TrainConfig, tokens: int, layers: list[int]) -> tuple:
        return (run.cp, run.recompute, run.offload, run.recompute_chunks, run.keep_selection, run.moe_chunk_tokens,
                run.loss_chunk_tokens, run.indexer_query_block, run.attention_query_block, tokens, tuple(layers))

    def get(self, run: TrainConfig, model_config: ModelConfig, tokens: int, layers: list[int],
            optimizer: bool = False) -> StepTrace:
        run = self.traced_run(run)
        key = self._key(run, tokens, layers)
        cached = self.cache.get(key)
        if cached is None or (optimizer and not cached.optimizer_peak):
            cached = self.cache[key] = trace_step(run, model_config, tokens, layers, fake=True, optimizer=optimizer)
        return cached

    def prefetch(self, requests: list[tuple[TrainConfig, int, bool]], model_config: ModelConfig,
                 layers: list[int]) -> None:
        """Trace (run, tokens, optimizer) requests not cached yet, in parallel processes (one per CPU core, at
        most 4): each trace is single-threaded Python (fake tensors compute nothing)."""
        todo, seen = [], set()
        for run, tokens, optimizer in requests:
            run = self.traced_run(run)
            key = self._key(run, tokens, layers)
            if key not in seen and (key not in self.cache or (optimizer and not self.cache[key].optimizer_peak)):
                seen.add(key)
                todo.append((key, run, tokens, optimizer))
        workers = min(len(todo), os.cpu_count() or 1, 4)
        if workers < 2 or multiprocessing.parent_process() is not None:
            for key, run, tokens, optimizer in todo:
                self.cache[key] = trace_step(run, model_config, tokens, layers, fake=True, optimizer=optimizer)
            return
        todo.sort(key=lambda item: -item[1].cp * item[2])  # the slowest first
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

        import genomelm.train.loop  # noqa: F401  (imported once here, not in every forked worker)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {key: pool.submit(trace_step, run, model_config, tokens, layers, True, optimizer)
                       for key, run, tokens, optimizer in todo}
            for key, future in futures.items():
                self.cache[key] = future.result()


def _trace_tokens(tokens: int, a: Assumptions) -> tuple[int, int]:
    """The token counts a rank's share is traced at: itself, or trace_tokens/2 and trace_tokens (extrapolated)."""
    t2 = min(tokens, a.trace_tokens)
    return (t2 // 2 if tokens > t2 else t2), t2


def _link(a: Assumptions, ranks: int) -> float:
    """Bytes per second of a collective over `ranks` consecutive ranks: NVLink inside a node, else the NICs."""
    return (a.nvlink_gbs if ranks <= a.gpus_per_node else a.ib_gbs) * 1e9


def plan_layout(config: TrainConfig, dp: int, cp: int, ep: int, assumptions: Assumptions,
                traces: _Traces | None = None, model_config: ModelConfig | None = None,
                numel: dict[str, int] | None = None) -> Plan:
    """The plan of one layout (dp x cp ranks, experts over ep) for `config`'s window and switches (fsdp,
    offload, optimizer_offload)."""
    model_config = model_config or resolve_model_config(config)
    numel = numel or model_numel(model_config)
    traces = traces or _Traces()
    a = assumptions.resolved(config.gpu)
    seq, world = config.seq_len, dp * cp
    if seq % cp or (seq // cp) % 128:
        raise ValueError(f"seq {seq:,} does not split into cp={cp} shards of whole 128-token pieces")
    if world % ep or model_config.n_routed_experts % ep:
        raise ValueError(f"ep={ep} must divide dp*cp={world} and the {model_config.n_routed_experts} routed experts")
    sharded = config.fsdp and world > 1
    opt_offload = config.optimizer_offload and sharded
    tokens = seq // cp
    run = dataclasses.replace(config, cp=cp, dp=1, ep=1)
    layers = reduced_layers(model_config)
    t1, t2 = _trace_tokens(tokens, a)
    traces.prefetch([(run, t2, not sharded), (run, t1, False)], model_config, layers)
    hi = traces.get(run, model_config, t2, layers, optimizer=not sharded)
    lo = traces.get(run, model_config, t1, layers) if t1 != t2 else hi

    def scale(x1: float, x2: float) -> float:
        return _extrapolate(x1, x2, t1, t2, tokens)

    representative = {layer_kind(model_config, i): i for i in layers}
    all_layers = range(model_config.num_hidden_layers)
    rep_of = {i: representative[layer_kind(model_config, i)] for i in all_layers}
    total_numel = sum(v for k, v in numel.items() if k != "experts")
    experts = numel["experts"]
    local_numel = total_numel / world if sharded else total_numel - experts + experts / ep
    traced_numel = sum(hi.param_numel.values())
    sparse = [i for i in all_layers if model_config.mlp_layer_types[i] == "sparse"]
    experts_per_layer = experts / max(1, len(sparse))

    def cat(trace: StepTrace, *names: str) -> int:
        return sum(trace.step_peak.get(n, 0) for n in names)

    # saved activations: traced layers at the peak, plus what each untraced layer keeps until its backward
    untraced = [i for i in all_layers if i not in layers]
    kept_more = sum(scale(lo.kept[rep_of[i]], hi.kept[rep_of[i]]) for i in untraced)
    chunk = {"mlp": config.moe_chunk_tokens, "lm_head": config.loss_chunk_tokens}  # modules that run in chunks
    transients = {k: max(0.0, _extrapolate(lo.transients.get(k, 0), v, t1, t2, min(tokens, chunk.get(
        k.split(".")[-1], tokens)))) for k, v in hi.transients.items()}
    if ep > 1 or sharded:  # the MoE layers: the busiest rank's rows of one chunk (see MOE_RULE)
        rows = (a.imbalance if ep > 1 else 1.0) * min(tokens, config.moe_chunk_tokens) * model_config.num_experts_per_tok
        per_row = (2 * model_config.hidden_size + 3 * model_config.moe_intermediate_size) * 2 * 2
        for k in transients:
            if k.endswith(".mlp") and model_config.mlp_layer_types[int(k.split(".")[1])] == "sparse":
                transients[k] = rows * per_row
    host_inputs = scale(lo.host_bytes, hi.host_bytes) * model_config.num_hidden_layers / len(layers)
    saved = scale(cat(lo, "Activation", "Temp", "Other") - max(lo.transients.values(), default=0),
                  cat(hi, "Activation", "Temp", "Other") - max(hi.transients.values(), default=0)) + kept_more
    traced_offload = _Traces.traced_run(run).offload
    if traced_offload and not config.offload:
        saved += host_inputs  # the layer inputs stay on the device
    device = {
        "parameters (fp32)": 0.0 if opt_offload else 4 * local_numel,
        "buffers": cat(hi, "Buffer") * total_numel / traced_numel,
        "gradients (fp32)": 0.0 if opt_offload else 4 * local_numel,
        "optimizer state (AdamW, 2 x fp32)": 0.0 if opt_offload else 8 * local_numel,
        "saved activations (all layers)": saved,
        "largest transient (module below)": max(transients.values(), default=0.0),
    }
    if sharded:
        largest_layer = max(numel[f"layers.{i}"] - (experts_per_layer - experts_per_layer / ep) * (i in sparse)
                            for i in all_layers)
        device["FSDP buffers (2 bf16 layers gathered, bf16 + fp32 gradient)"] = largest_layer * (2 * 2 + 2 + 4)
        opt_phase = sum(device[k] for k in ("parameters (fp32)", "buffers", "gradients (fp32)",
                                            "optimizer state (AdamW, 2 x fp32)"))
    else:  # traced: the gradient sum, clipping and AdamW (its temporaries), per parameter
        opt_phase = hi.optimizer_peak_total * local_numel / traced_numel
    peak = max(sum(device.values()), opt_phase)
    device["optimizer step peak (separate phase)"] = opt_phase
    ranks_per_node = min(a.gpus_per_node, world)
    host = {}
    if config.offload:
        host["offloaded layer inputs (pinned)"] = host_inputs * ranks_per_node
    if opt_offload:
        host["optimizer offload: fp32 parameters, gradients, AdamW (pinned)"] = 16 * local_numel * ranks_per_node
    usable = GPUS[config.gpu][0]

    flops = {k: _quadratic(lo.flops[k], hi.flops[k], t1, t2, tokens) for k in hi.flops}
    rank_flops = flops["rest"] + sum(flops[f"layers.{rep_of[i]}"] for i in all_layers)
    expert_flops = sum(_extrapolate(lo.expert_flops.get(f"layers.{rep_of[i]}", 0),
                                    hi.expert_flops.get(f"layers.{rep_of[i]}", 0), t1, t2, tokens) for i in sparse)
    busiest_flops = rank_flops + (a.imbalance - 1) * expert_flops if ep > 1 else rank_flops
    comm, comm_s = _comm(lo, hi, scale, rep_of, all_layers, numel, total_numel, local_numel, cp, world, ep, tokens,
                         model_config, a, sharded)
    compute_s = busiest_flops / (a.tflops * 1e12 * a.mfu)
    host_s = 0.0  # offload copies over PCIe: layer inputs out and back per window; with optimizer offload, per
    if config.offload:  # optimizer step the fp32 gradients down and the fp32 parameters up
        host_s += 2 * host_inputs / (a.pcie_gbs * 1e9)
    if opt_offload:
        host_s += 2 * 4 * local_numel / config.grad_accum / (a.pcie_gbs * 1e9)
    step_s = compute_s + comm_s + host_s
    notes = []
    if config.optimizer_offload and not sharded:
        notes.append("optimizer_offload needs FSDP over more than one rank (fsdp=true, dp*cp > 1): ignored")
    if t1 != t2:
        notes.append(f"traced {len(layers)} of {model_config.num_hidden_layers} layers at {t1:,} and {t2:,} tokens "
                     f"per rank; bytes extrapolated linearly to {tokens:,}, FLOPs as a*t + b*t^2")
    else:
        notes.append(f"traced {len(layers)} of {model_config.num_hidden_layers} layers at {tokens:,} tokens per "
                     "rank, scaled by the layer counts")
    return Plan(
        run=config.run, seq=seq, gpus=world, gpu=config.gpu, dp=dp, cp=cp, ep=ep, recompute=config.recompute,
        offload=config.offload, optimizer_offload=opt_offload, fsdp=sharded, fits=peak <= usable * GIB and sum(host.values()) <= a.host_gib * GIB,
        usable_gib=usable, peak_gib_per_rank=peak / GIB,
        device_gib={k: v / GIB for k, v in device.items()},
        transients_gib={k: v / GIB for k, v in transients.items()},
        host_gib_per_node={k: v / GIB for k, v in host.items()},
        flops_per_token=rank_flops / tokens, comm_bytes_per_step={k: v * config.grad_accum for k, v in comm.items()},
        step_s=step_s * config.grad_accum, tokens_per_s_projected=dp * seq / max(step_s, 1e-9),
        assumptions=dataclasses.asdict(a) | {
            "compute_s": compute_s, "comm_s": comm_s, "host_copy_s": host_s, "busiest_rank_flops_per_token": busiest_flops / tokens,
            "overlap": "none: compute, every collective and the offload copies add up", "sharding": SHARDING_RULE, "moe": MOE_RULE,
            "offload": OFFLOAD_RULE},
        notes=notes,
    )


def _comm(lo: StepTrace, hi: StepTrace, scale: Any, rep_of: dict[int, int], all_layers: range,
          numel: dict[str, int], total_numel: int, local_numel: float, cp: int, world: int, ep: int, tokens: int,
          model_config: ModelConfig, a: Assumptions, sharded: bool) -> tuple[dict[str, float], float]:
    """Bytes one rank moves per window (the traced context-parallel collectives scaled by layer, plus the
    computed FSDP, gradient and expert-parallel ones), and their time at the link each group runs over."""
    out: dict[str, float] = {}
    seconds = 0.0

    def add(name: str, value: float, ranks: int) -> None:
        nonlocal seconds
        out[name] = out.get(name, 0.0) + value
        seconds += value / _link(a, ranks)

    for i in all_layers:
        part = f"layers.{rep_of[i]}"
        for kind, size in hi.comm.get(part, {}).items():
            add(f"cp {kind}", scale(lo.comm.get(part, {}).get(kind, 0), size), cp)
    for kind, size in hi.comm.get("rest", {}).items():
        if not (kind == "all_reduce" and size > 1024):  # not the packed gradient sum (computed below)
            add(f"cp {kind}", size, cp)
    experts = numel["experts"]
    if sharded:
        edp = world // ep
        gathered = ((total_numel - experts) * (world - 1) / world + experts / ep * (edp - 1) / edp)
        add("fsdp all_gather (bf16, forward + recompute)", 2 * 2 * gathered, world)
        add("fsdp reduce_scatter (fp32 gradients)", 4 * gathered, world)
    elif world > 1:  # every rank's gradients summed (one packed all-reduce; ring: twice the bytes)
        add("gradient all_reduce (fp32)", 2 * 4 * local_numel * (world - 1) / world, world)
    if ep > 1:
        moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types)
        per_layer = tokens * model_config.num_experts_per_tok * model_config.hidden_size * 2 * (ep - 1) / ep
        add("ep all_to_all (dispatch + combine; forward, recompute, backward)",
            per_layer * 2 * 3 * moe_layers * a.imbalance, ep)
    return out, seconds


def make_plan(config: TrainConfig, assumptions: Assumptions | None = None, traces: _Traces | None = None) -> Plan:
    """The plan for the run's own layout (gpus = dp*cp; `gpus` alone: cp = gpus)."""
    assumptions = assumptions or load_assumptions(config)
    dp, cp, ep = config.dp, config.cp, config.ep
    if config.gpus and dp * cp != config.gpus:
        if dp == 1 and cp == 1:
            cp = config.gpus
        else:
            raise ValueError(f"dp={dp} x cp={cp} is not gpus={config.gpus}")
    return plan_layout(config, dp, cp, ep, assumptions, traces)


def search(config: TrainConfig, assumptions: Assumptions | None = None, traces: _Traces | None = None) -> list[Plan]:
    """Every dp x cp x ep layout of `config.gpus` (with offload and optimizer_offload on and off), ranked: fitting
    first, then by projected tokens/s. One pair of traces per cp (see `_Traces`)."""
    assumptions = assumptions or load_assumptions(config)
    model_config = resolve_model_config(config)
    numel = model_numel(model_config)
    traces = traces or _Traces()
    gpus = config.gpus or 64
    a = assumptions.resolved(config.gpu)
    cps = [cp for cp in _powers_of_two(gpus) if not (config.seq_len % cp or (config.seq_len // cp) % 128)]
    runs = [dataclasses.replace(config, cp=cp, dp=1, ep=1) for cp in cps]
    sharded = config.fsdp and gpus > 1
    traces.prefetch([(run, t, t == t2 and not sharded) for run in runs
                     for t, t2 in [(t, _trace_tokens(config.seq_len // run.cp, a)[1])
                                   for t in _trace_tokens(config.seq_len // run.cp, a)]],
                    model_config, reduced_layers(model_config))
    plans = []
    for cp in _powers_of_two(gpus):
        if config.seq_len % cp or (config.seq_len // cp) % 128:
            continue
        for ep in _powers_of_two(gpus):
            if model_config.n_routed_experts % ep:
                continue
            for offload in (True, False):
                for opt_offload in (False, True):
                    if opt_offload and not (config.fsdp and gpus > 1):
                        continue
                    run = dataclasses.replace(config, offload=offload, optimizer_offload=opt_offload)
                    plans.append(plan_layout(run, gpus // cp, cp, ep, assumptions, traces, model_config, numel))
    return rank(plans)


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting first; then by projected tokens/s; at equal speed the smaller peak, then less host memory."""
    return sorted(plans, key=lambda p: (not p.fits, -round(p.tokens_per_s_projected), p.peak_gib_per_rank,
                                        p.host_gib_total))


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1) if n % 2**k == 0]


def load_assumptions(config: TrainConfig) -> Assumptions:
    """Assumptions from `config.extra` (the plan command's own key=value settings) and the run's metrics."""
    fields = {f.name: f for f in dataclasses.fields(Assumptions)}
    values: dict[str, Any] = {}
    for key, value in config.extra.items():
        default = fields[key].default
        values[key] = (str(value).lower() in ("1", "true", "yes", "on")) if isinstance(default, bool) else type(
            default)(value)
    measured = measured_imbalance(config)
    if "imbalance" in values:
        values["imbalance_source"] = "set"
    elif measured is not None:
        values["imbalance"] = measured
        values["imbalance_source"] = f"measured (runs/{config.run}/metrics.jsonl, router max_over_mean)"
    return Assumptions(**values)


def layout_args(plan: Plan) -> str:
    """The key=value settings of a plan's layout."""
    return (f"dp={plan.dp} cp={plan.cp} ep={plan.ep} offload={str(plan.offload).lower()} "
            f"optimizer_offload={str(plan.optimizer_offload).lower()}")


def refusal(config: TrainConfig, plan: Plan, candidates: list[Plan]) -> str:
    """Why the run does not fit, and the best layout of the same GPUs that does."""
    best = next((p for p in candidates if p.fits), None)
    fix = (f"best layout that fits {plan.gpus} x {config.gpu.upper()}: {layout_args(best)} "
           f"({best.peak_gib_per_rank:.1f} GiB per rank, {best.host_gib_total:,.0f} GiB host per node, "
           f"{best.tokens_per_s_projected:,.0f} tokens/s projected)"
           if best else f"no layout of {plan.gpus} x {config.gpu.upper()} fits (best: {candidates[0].peak_gib_per_rank:.1f} "
           f"GiB per rank with {layout_args(candidates[0])})" if candidates else f"no layout of {plan.gpus} GPUs fits")
    return (f"run {config.run} does not fit: {plan.peak_gib_per_rank:.1f} GiB per rank > {plan.usable_gib:.0f} GiB "
            f"usable on {config.gpu.upper()} ({layout_args(plan)}); {fix}; force=true trains anyway")


def check_fits(config: TrainConfig) -> Plan:
    """The trainer's check before training: the run's plan, or PlanError naming the best layout that fits
    (unless `force=true`)."""
    traces = _Traces()
    plan = make_plan(config, traces=traces)
    if plan.fits or config.force:
        return plan
    raise PlanError(refusal(config, plan, search(dataclasses.replace(config, gpus=plan.gpus), traces=traces)))


def describe(plan: Plan) -> str:
    """The plan as a table."""
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        (f"plan {plan.run}: {plan.seq:,}-token windows on {plan.gpus} x {plan.gpu.upper()} "
         f"(dp {plan.dp} x cp {plan.cp}, ep {plan.ep}; fsdp {plan.fsdp}; recompute {plan.recompute}, offload "
         f"{plan.offload}, optimizer_offload {plan.optimizer_offload})"),
        (f"  {verdict}: peak {plan.peak_gib_per_rank:,.1f} GiB per rank of {plan.usable_gib:.0f} GiB usable; host "
        f"{plan.host_gib_total:,.0f} GiB per node of {plan.assumptions['host_gib']:,.0f} GiB"),
        "  device memory per rank (GiB):",
    ]
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.device_gib.items()]
    lines.append("  transients by module (GiB):")
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.transients_gib.items()]
    lines.append(f"  host memory per node (GiB): {plan.host_gib_total:,.1f}")
    lines += [f"    {k:<58} {v:>10,.1f}" for k, v in plan.host_gib_per_node.items()]
    lines.append(f"  FLOPs per token (per rank, recompute included): {plan.flops_per_token:.3e}"
                 f" (busiest expert-parallel rank: {plan.assumptions['busiest_rank_flops_per_token']:.3e})")
    lines.append("  bytes communicated per step per rank:")
    lines += [f"    {k:<58} {v / 1e9:>10,.2f} GB" for k, v in plan.comm_bytes_per_step.items()]
    a = plan.assumptions
    lines.append(f"  projected: {plan.step_s:,.1f} s per step, {plan.tokens_per_s_projected:,.0f} tokens/s "
                 f"(compute {a['compute_s']:.2f} s + communication {a['comm_s']:.2f} s + offload copies "
                 f"{a['host_copy_s']:.2f} s per window, no overlap)")
    lines.append(f"  assumptions: mfu={a['mfu']} tflops={a['tflops']} nvlink_gbs={a['nvlink_gbs']} ib_gbs={a['ib_gbs']}"
                 f" pcie_gbs={a['pcie_gbs']} gpus_per_node={a['gpus_per_node']} host_gib={a['host_gib']:.0f}"
                 f" imbalance={a['imbalance']:.2f} ({a['imbalance_source']})"
                 f" trace_tokens={a['trace_tokens']}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def describe_search(plans: list[Plan], limit: int = 0) -> str:
    rows = [(f"{'fits':<5} {'dp':>3} {'cp':>3} {'ep':>3} {'offload':<8} {'opt_offload':<12} {'peak GiB':>10} "
             f"{'host GiB/node':>14} {'tokens/s':>10}")]
    for p in plans[:limit or None]:
        rows.append(f"{'yes' if p.fits else 'no':<5} {p.dp:>3} {p.cp:>3} {p.ep:>3} {str(p.offload).lower():<8} "
                    f"{str(p.optimizer_offload).lower():<12} {p.peak_gib_per_rank:>10,.1f} {p.host_gib_total:>14,.1f} "
                    f"{p.tokens_per_s_projected:>10,.0f}")
    if limit and len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more in plan.json")
    return "\n".join(rows)


def describe_run(config: TrainConfig) -> str:
    """`dry_run=true`: the plan of the run's own layout, with the model's layer paths; when it does not fit, the
    line `make train` refuses it with (naming the best layout that fits)."""
    model_config = resolve_model_config(config)
    model = GlmForCausalLM.from_config(model_config, device="meta")
    n = sum(p.numel() for p in model.parameters())
    runner = LayerRunner(recompute=config.recompute, offload=config.offload, keep_selection=config.keep_selection,
                         recompute_chunks=config.recompute_chunks)
    head = (f"run {config.run}: model {config.model or 'not set, sized as glm-5.3-flash'} ({n / 1e9:.2f}B parameters, "
            f"{len(model_config.kda_layers)} KDA + {len(model_config.dsa_layers)} DSA layers)\n\nlayer paths:\n"
            f"{model.path_table()}\n\nmemory switches: {runner.describe()}\n")
    traces = _Traces()
    plan = make_plan(config, traces=traces)
    out = head + "\n" + describe(plan)
    if not plan.fits and not config.force:  # what training would refuse with
        out += "\n\n" + refusal(config, plan, search(dataclasses.replace(config, gpus=plan.gpus), traces=traces))
    return out


def write_plan(config: TrainConfig, plans: list[Plan]) -> Path:
    path = config.run_dir / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    """plans[0]: the run's own layout; the rest (search=true), ranked, under "search"."""
    body = plans[0].to_json() | ({"search": [p.to_json() for p in plans[1:]]} if len(plans) > 1 else {})
    path.write_text(json.dumps(body, indent=2))
    return path


