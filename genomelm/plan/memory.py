"""Bytes per rank: the traced step (one decoder layer of each kind, cached per cp) read at the rank's tokens
and scaled to every layer, plus the parameters, gradients and optimizer state by the sharding rules below
(their bytes per tensor for the run's `optimizer`: `genomelm.plan.optimizer_bytes`); for
the evaluation (stage=eval), the traced forward read the same way, plus the parameters as stored
(`EVAL_RULE`)."""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path

import torch

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.model.config import MOE, is_preset
from genomelm.plan import rates
from genomelm.plan.layouts import GIB, GPUS, Assumptions, Layout
from genomelm.plan.low_precision import transient_bytes
from genomelm.plan.optimizer_bytes import StateBytes, state_bytes
from genomelm.plan.trace import (
    StepTrace,
    eval_param_dtype,
    layer_kind,
    reduced_layers,
    trace_forward,
    trace_step,
)
from genomelm.run.config import TrainConfig
from genomelm.run.models import model_config_of
from genomelm.train.optimizer import BF16_WEIGHTS

SHARDING_RULE = (
    "bytes per rank from the model's parameter tensors (meta device), W = dp*cp ranks: with FSDP2 "
    "(fsdp=true, W > 1) every parameter, its gradient and its optimizer state are sharded over all W ranks "
    "along dim 0; the routed experts are split over ep ranks (E/ep each) and sharded again over the W/ep "
    "ranks holding the same experts, so each rank holds (all parameters) / W x the optimizer's bytes per "
    "parameter (`optimizer` rule: adamw 4 + 4 + 8 B; adamw8bit 4 + 4 + ~2.03 B; adamw_bf16 ~2 + 2 + ~2.03 "
    "B), and the largest rank ceil(dim0 / shards) rows of each tensor (FSDP padding, counted apart); FSDP "
    "gathers one decoder layer in bf16 while it prefetches the next, or with fsdp_prefetch=N > 1 the next "
    "N ((1 + max(1, N)) x 2 B per parameter of the largest layer, its experts / ep: the backward's, which "
    "holds at least as many as the forward's 1 + N) and reduce-scatters its gradient from a bf16 + fp32 copy "
    "(6 B; with reduce_dtype=bf16 a bf16 copy: 4 B); without FSDP "
    "each rank holds every parameter (experts / ep) at those bytes; optimizer_offload=true keeps the "
    "weights, gradients and optimizer state in pinned host memory (FSDP2 CPUOffloadPolicy), leaving the "
    "gathered bf16 layers on the GPU"
)
MOE_RULE = (
    "expert parallelism: the busiest rank receives `imbalance` x the mean routed rows (its expert FLOPs and "
    "its all-to-all bytes scale by it); with recompute and without recompute_chunks a layer's recompute "
    "saves the tensors of every moe_chunk_tokens chunk of its feed-forward at once and holds them until the "
    "module's backward, so that transient grows with the rank's tokens: as traced (linear in tokens), but "
    "for the bf16 copies of the rank's expert weights each chunk's grouped GEMMs save (E/ep x 3 x hidden x "
    "moe_intermediate x 2 B per chunk; none with FSDP, which gathers them in bf16) and, with EP, the busiest "
    "rank's (imbalance - 1) x tokens x top-k rows more, at the bytes the experts save per row (measured on "
    "fake tensors); recompute_chunks holds one chunk at a time; with FSDP or EP the MoE backward's own "
    "transient is the busiest rank's rows of one moe_chunk_tokens chunk: rows x (2 hidden + 3 "
    "moe_intermediate) x 2 B (the dispatched rows, gate/up, SwiGLU and output in bf16) x 2 (with their "
    "gradients; x 1, the gradients, where the held tensors are counted apart), the expert weights' bf16 "
    "copies and gradients being the FSDP buffers; all-to-all bytes: tokens x top-k x hidden x 2 B each way "
    "(dispatch, combine) per MoE layer, in the forward, the recompute and the backward; with ep_overlap the "
    "forward also holds the next chunk's rows in flight, (1 + imbalance) x chunk x top-k x hidden x 2 B, "
    "less than the backward's gradients of a chunk (imbalance x chunk x top-k x (2 hidden + 3 "
    "moe_intermediate) x 2 B), so the MoE's transient stays the backward's; with expert_placement=balanced "
    "the time takes the imbalance after placement and the memory the static blocks' (a run places its "
    "experts at resume, so it starts on them), and with expert_copies the copies' weights the busiest rank "
    "sends and receives per layer pass, and their gradients, are added to the MoE's transient (every MoE "
    "layer's, held to the backward, without recompute)"
)
OFFLOAD_RULE = (
    "traced with offload=true (with recompute, offload moves only each layer's saved input to the host); "
    "offload=false adds those bytes back to the device; traced with torch's AdamW whatever the optimizer "
    "(the update phase of a layout without FSDP scaled by the optimizer's weights, gradients and state over "
    "AdamW's; with FSDP those are computed)"
)
EVAL_RULE = (
    "the evaluation (stage=eval): the evaluator's forward of one window traced under no_grad (bf16 autocast "
    "when the precision resolves to bf16 on CUDA), per-token losses through the context-parallel scorer; "
    "nothing is saved for a backward, no gradients, no optimizer state, no recompute, no offload. The "
    "parameters are stored in the run's precision (bf16 with the parameters the model declares fp32 kept "
    "fp32, else fp32; bytes of that build on the meta device) and split as in training: with FSDP2 "
    "(fsdp=true, W = dp*cp > 1) all of them over the W ranks (the experts over ep, then over the W/ep ranks "
    "holding them), else every parameter with the experts / ep; FSDP2 holds the root unit gathered "
    "(embedding, final norm, head: it does not reshard the root after the forward) and two decoder layers "
    "(the running one and the next, gathered ahead), each as stored, its experts / ep; live through the "
    "forward: at the module whose start + transient is the largest, what was live as it started (linear in "
    "the rank's tokens) and its transient; the transients as in training (the feed-forward's and the head's "
    "up to their chunk), the MoE's with EP plus the busiest rank's (imbalance - 1) x chunk x top-k rows "
    "more, (2 hidden + 3 moe_intermediate) x the compute dtype's bytes each (dispatched rows, gate/up, "
    "SwiGLU, output), and with ep_overlap the next chunk's rows in flight, sent and received ((1 + "
    "imbalance) x chunk x top-k x hidden x the compute dtype's bytes); the per-token loss all-gathered over "
    "cp (the parts, their concatenation and the window-ordered copy: 3 x S x 4 B; at cp 1 the [S] fp32 "
    "output) is added to the peak, though it lives after the last layer (an upper bound by a few MiB)"
)


def resolve_model_config(config: TrainConfig) -> ModelConfig:
    """The run's architecture; without a model set, the GLM-5.3-Flash architecture the hg38 configs train."""
    if not config.model:
        return ModelConfig.preset("glm-5.3-flash")
    if not is_preset(config.model) and not Path(config.model).exists():
        raise FileNotFoundError(f"model {config.model!r} is neither a preset in configs/model/ nor a folder")
    return model_config_of(config.model)


def model_numel(model_config: ModelConfig) -> dict[str, int]:
    """Parameters per decoder layer ("layers.<i>") and of the rest, counted on the meta device; "experts": the
    routed experts' share of the total."""
    model = GlmForCausalLM.from_config(model_config, device="meta")
    out = {f"layers.{i}": sum(p.numel() for p in layer.parameters()) for i, layer in enumerate(model.layers)}
    out["rest"] = sum(p.numel() for p in model.parameters()) - sum(out.values())
    out["experts"] = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return out


def model_bytes(model_config: ModelConfig, options: RunOptions, dtype: torch.dtype) -> dict[str, int]:
    """`model_numel`'s parts in bytes of the model built in `dtype` on the meta device (the parameters the
    model declares fp32 stay fp32): what the evaluator stores."""
    model = GlmForCausalLM.from_config(model_config, options, dtype, "meta")

    def size(params: list[torch.nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    out = {f"layers.{i}": size(list(layer.parameters())) for i, layer in enumerate(model.layers)}
    out["rest"] = size(list(model.parameters())) - sum(out.values())
    out["experts"] = size([p for n, p in model.named_parameters() if ".mlp.experts." in n])
    return out


def extrapolate_line(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """The line through (t1, a) and (t2, b) at t."""
    return b if t == t2 or t1 == t2 else b + (b - a) * (t - t2) / (t2 - t1)


def extrapolate_quadratic(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """c1*t + c2*t^2 through (t1, a) and (t2, b), at t."""
    if t == t2:
        return b
    c2 = (b / t2 - a / t1) / (t2 - t1)
    c1 = a / t1 - c2 * t1
    return c1 * t + c2 * t * t


def trace_token_counts(tokens: int, a: Assumptions) -> tuple[int, int]:
    """The token counts a rank's share is traced at: itself, or trace_tokens/2 and trace_tokens (read off the
    line or the quadratic through the two)."""
    t2 = min(tokens, a.trace_tokens)
    return (t2 // 2 if tokens > t2 else t2), t2


def _trace(
    run: TrainConfig, model_config: ModelConfig, tokens: int, layers: list[int], optimizer: bool
) -> StepTrace:
    """The run's stage traced on fake tensors: the training step, or the evaluator's forward."""
    if run.plan.stage == "eval":
        return trace_forward(run, model_config, tokens, layers, fake=True)
    return trace_step(run, model_config, tokens, layers, fake=True, optimizer=optimizer)


class TraceCache:
    """Traces at one or two token counts per context-parallel size, cached across layouts: dp, ep, FSDP and
    optimizer offload change bytes in known proportion (computed), and offload only where the saved layer
    inputs live (with recompute), so one pair of traces per cp serves every layout with that cp. The
    evaluation's forward (stage=eval) is cached apart, by the dtype its parameters are stored in."""

    def __init__(self) -> None:
        self.cache: dict[tuple, StepTrace] = {}
        self.scaled: dict[tuple, ScaledTraces] = {}  # by (id(lo), id(hi), tokens): the pair read at tokens

    def scaled_of(
        self,
        lo: StepTrace,
        hi: StepTrace,
        t1: int,
        t2: int,
        tokens: int,
        layers: list[int],
        rep_of: dict[int, int],
    ) -> ScaledTraces:
        """One `ScaledTraces` of `lo` and `hi` (cached traces: the model and t1, t2 are in their keys) at
        `tokens`, shared by every layout that reads them there (and its memo of their projections)."""
        key = (id(lo), id(hi), tokens)  # the entry holds lo and hi, so their ids are not reused
        scaled = self.scaled.get(key)
        if scaled is None or scaled.lo is not lo or scaled.hi is not hi:
            scaled = self.scaled[key] = ScaledTraces(lo, hi, t1, t2, tokens, layers, rep_of)
        return scaled

    @staticmethod
    def traced_run(run: TrainConfig) -> TrainConfig:
        """The run as traced: training with recompute, offload on (`OFFLOAD_RULE`); training with torch's
        AdamW whatever the run's optimizer, so one trace serves every choice: the low-bit update cannot run
        on fake tensors (torchao's quantiser reads a value: a data-dependent op), and the optimizer's bytes
        are computed (`optimizer_bytes`); training and evaluation with the expert GEMMs in bf16 (on the CPU
        a low precision runs emulated, with fp32 copies: `genomelm.plan.low_precision` counts it in
        training; the evaluation's forward is costed in bf16)."""
        if run.plan.stage != "train":
            return run.replace(expert_precision="bf16")
        offload = {"offload": True} if run.memory.recompute else {}
        return run.replace(optimizer="adamw", expert_precision="bf16", **offload)

    def _key(self, run: TrainConfig, model_config: ModelConfig, tokens: int, layers: list[int]) -> tuple:
        """All that `_trace` reads of the traced run (`traced_run`) and the model: what a search's layouts
        change (dp, ep, FSDP, optimizer offload, the optimizer and its precision, the assumptions) is not
        read, so one cache serves a search, and any plans of the same model and settings besides."""
        memory = run.memory
        if run.plan.stage == "eval":  # the memory switches are the training step's
            switches: tuple = (eval_param_dtype(run),)
        else:  # fp32 weights under bf16 autocast whatever the precision; the optimizer's settings, not its
            # schedule (one step is traced, at a given lr)
            switches = (memory.recompute, memory.offload, memory.recompute_chunks, memory.keep_selection)
            schedule = {"steps": 0, "epochs": 0.0, "warmup_steps": 0, "min_lr_ratio": 0.0, "max_bad_steps": 0}
            switches += astuple(replace(run.optim, **schedule))
        parallel = run.parallel
        return (
            repr(model_config),
            run.plan.stage,
            run.seq_len,  # the indexer kernel's score workspace is sized by the traced share of the window
            parallel.cp,
            parallel.cp_layout,
            parallel.ep_capacity_factor,
            parallel.ep_overlap,
            *switches,
            astuple(run.model_options),
            tokens,
            tuple(layers),
        )

    def get(
        self,
        run: TrainConfig,
        model_config: ModelConfig,
        tokens: int,
        layers: list[int],
        optimizer: bool = False,
    ) -> StepTrace:
        run = self.traced_run(run)
        key = self._key(run, model_config, tokens, layers)
        cached = self.cache.get(key)
        if cached is None or (optimizer and not cached.optimizer_peak):
            cached = self.cache[key] = _trace(run, model_config, tokens, layers, optimizer)
        return cached

    def prefetch(
        self, requests: list[tuple[TrainConfig, int, bool]], model_config: ModelConfig, layers: list[int]
    ) -> None:
        """Trace (run, tokens, optimizer) requests not cached yet, in parallel processes (one per CPU core, at
        most 4): each trace is single-threaded Python (fake tensors compute nothing)."""
        todo, seen = [], set()
        for run, tokens, optimizer in requests:
            run = self.traced_run(run)
            key = self._key(run, model_config, tokens, layers)
            cached = self.cache.get(key)
            if key not in seen and (cached is None or (optimizer and not cached.optimizer_peak)):
                seen.add(key)
                todo.append((key, run, tokens, optimizer))
        workers = min(len(todo), os.cpu_count() or 1, 4)
        if workers < 2 or multiprocessing.parent_process() is not None:
            for key, run, tokens, optimizer in todo:
                self.cache[key] = _trace(run, model_config, tokens, layers, optimizer)
            return
        todo.sort(key=lambda item: -item[1].parallel.cp * item[2])  # the slowest first
        # what trace_step imports when it runs: imported once here, not in every forked worker
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {
                key: pool.submit(_trace, run, model_config, tokens, layers, optimizer)
                for key, run, tokens, optimizer in todo
            }
            for key, future in futures.items():
                self.cache[key] = future.result()


@dataclass
class ScaledTraces:
    """One rank's step traced at t1 and t2 tokens (`lo`, `hi`; the same trace when t1 == t2) over one decoder
    layer of each kind, read at the rank's `tokens`."""

    lo: StepTrace
    hi: StepTrace
    t1: int
    t2: int
    tokens: int
    layers: list[int]  # the traced layers
    rep_of: dict[int, int]  # every layer of the model -> the traced layer of its kind
    # what `genomelm.plan.timing` reads off the pair (op classes projected, their seconds by pass), by what it
    # is read with: the layouts sharing the traces (`TraceCache.scaled_of`) differ in switches it does not see
    projections: dict[tuple, list] = field(default_factory=dict, repr=False, compare=False)

    def line(self, at_t1: float, at_t2: float, tokens: int | None = None) -> float:
        """Bytes at `tokens` (default: the rank's) on the line through the two traces."""
        return extrapolate_line(at_t1, at_t2, self.t1, self.t2, self.tokens if tokens is None else tokens)

    def quadratic(self, at_t1: float, at_t2: float) -> float:
        """FLOPs at the rank's tokens on a*t + b*t^2 through the two traces."""
        return extrapolate_quadratic(at_t1, at_t2, self.t1, self.t2, self.tokens)


def scaled_traces(
    config: TrainConfig,
    model_config: ModelConfig,
    cp: int,
    a: Assumptions,
    traces: TraceCache,
    optimizer: bool,
) -> ScaledTraces:
    """The traces of one rank of `cp` (from `traces`, tracing what is missing), with the optimizer phase
    traced when `optimizer` (a layout without FSDP: its optimizer bytes are traced, not computed)."""
    tokens = config.seq_len // cp
    run = config.replace(cp=cp, dp=1, ep=1)
    layers = reduced_layers(model_config)
    t1, t2 = trace_token_counts(tokens, a)
    traces.prefetch([(run, t2, optimizer), (run, t1, False)], model_config, layers)
    hi = traces.get(run, model_config, t2, layers, optimizer=optimizer)
    lo = traces.get(run, model_config, t1, layers) if t1 != t2 else hi
    representative = {layer_kind(model_config, i): i for i in layers}
    rep_of = {i: representative[layer_kind(model_config, i)] for i in range(model_config.num_hidden_layers)}
    return traces.scaled_of(lo, hi, t1, t2, tokens, layers, rep_of)


@dataclass(frozen=True)
class ParameterShare:
    """The model's parameter counts (`model_numel`; for the evaluation, their bytes as stored: `model_bytes`)
    and what one rank of a layout holds of them."""

    numel: dict[str, int]  # by part, as `model_numel` (or `model_bytes`)
    total: int  # every parameter
    experts: int  # the routed experts' share of `total`
    local: float  # one rank's: total / dp*cp with FSDP2, else every parameter with the experts / ep

    @classmethod
    def of(cls, numel: dict[str, int], layout: Layout) -> ParameterShare:
        total = sum(v for k, v in numel.items() if k != "experts")
        experts = numel["experts"]
        local = total / layout.world if layout.sharded else total - experts + experts / layout.ep
        return cls(numel, total, experts, local)


def usable_gib(config: TrainConfig) -> float:
    """Device memory a rank may use: `plan.gpu_gib`, capped at the GPU's usable memory (a budget set for
    one GPU stays within a smaller one), else the GPU's usable memory."""
    device = GPUS[config.plan.gpu][0]
    return min(config.plan.gpu_gib, device) if config.plan.gpu_gib else device


@dataclass
class RankMemory:
    """Bytes of one rank of a layout (device, by category and module) and of its node's host memory."""

    device: dict[str, float]  # by category; the last, the optimizer step's own peak (a separate phase)
    transients: dict[str, float]  # by module: its peak over what was live when it started
    host: dict[str, float]  # pinned host memory of the node's ranks, by what it holds
    host_inputs: float  # bytes of the saved layer inputs one rank offloads per window
    peak: float  # the larger of the forward/backward peak and the optimizer step's
    usable: float  # GiB of the GPU

    def fits(self, a: Assumptions) -> bool:
        return self.peak <= self.usable * GIB and sum(self.host.values()) <= a.host_gib * GIB


def chunked_transients(config: TrainConfig, steps: ScaledTraces) -> dict[str, float]:
    """Each traced module's transient on the line through the two traces, at the rank's tokens, or only up to
    their chunk for the chunked modules (feed-forward: moe_chunk_tokens, loss head: loss_chunk_tokens). A
    module whose peak moment changes with size (a constant per-block temporary at the traced sizes, one that
    grows with the window at full size) is read as the largest of its forward's moments, each on its own
    line (`StepTrace.moments`: by the innermost module and the genomelm function running), and its own
    line."""
    lo, hi, tokens = steps.lo, steps.hi, steps.tokens
    options = config.model_options
    chunk = {"mlp": options.moe_chunk_tokens, "lm_head": options.loss_chunk_tokens}
    out = {}
    for k, v in hi.transients.items():
        at = min(tokens, chunk.get(k.split(".")[-1], tokens))
        value = steps.line(lo.transients.get(k, 0), v, at)
        lo_moments, hi_moments = lo.moments.get(k, {}), hi.moments.get(k, {})
        for inner in hi_moments.keys() & lo_moments.keys():
            value = max(value, steps.line(lo_moments[inner], hi_moments[inner], at))
        out[k] = max(0.0, value)
    return out


def module_transients(
    config: TrainConfig, model_config: ModelConfig, layout: Layout, steps: ScaledTraces, a: Assumptions
) -> dict[str, float]:
    """Each traced module's transient at the rank's tokens: the backward of the chunked modules (feed-forward:
    moe_chunk_tokens, loss head: loss_chunk_tokens) only up to their chunk, the MoE layers' by `MOE_RULE`
    with FSDP or EP (and what a low expert_precision's GEMMs hold more: `low_precision.transient_bytes`);
    plus, where a layer's recompute holds every chunk at once, the feed-forward tensors its recompute holds
    until its backward (`recompute_held`)."""
    tokens, options = steps.tokens, config.model_options
    transients = chunked_transients(config, steps)
    held = recompute_held(config, model_config, layout, steps, a)
    if layout.ep > 1 or layout.sharded:  # the busiest rank's rows of one chunk
        rows = (
            (a.sized_imbalance if layout.ep > 1 else 1.0)
            * min(tokens, options.moe_chunk_tokens)
            * model_config.num_experts_per_tok
        )
        # the chunk's tensors and their gradients, or the gradients alone where `held` counts the tensors
        per_row = (
            (2 * model_config.hidden_size + 3 * model_config.moe_intermediate_size) * 2 * (1 if held else 2)
        )
        # with copies: the weights the busiest rank sends and receives, and their gradients; without a layer
        # recompute every MoE layer's copies stay saved for its backward
        c = model_config
        expert = 3 * c.hidden_size * c.moe_intermediate_size * copy_width(config, layout)
        held_layers = 1 if config.memory.recompute else sum(t == MOE for t in c.mlp_layer_types)
        copies = 2 * a.copy_weights * expert * held_layers if layout.ep > 1 else 0.0
        quantised = transient_bytes(c, layout, options.expert_precision, rows)
        for k in transients:
            if k.endswith(".mlp") and model_config.mlp_layer_types[int(k.split(".")[1])] == MOE:
                transients[k] = rows * per_row + copies + quantised
    return {k: v + held.get(k, 0.0) for k, v in transients.items()}


def copy_width(config: TrainConfig, layout: Layout) -> int:
    """Bytes per weight of the copies' exchange: the weights as the step computes with them, bf16 where
    FSDP2 gathers them so (a bf16 run on GPUs: "auto" too), else the fp32 parameters."""
    return 2 if layout.sharded and config.memory.precision != "fp32" else 4


def holds_every_chunk(config: TrainConfig) -> bool:
    """Whether a layer's recompute (in its backward) saves every feed-forward chunk's tensors at once, held
    until the module's backward: recompute without recompute_chunks (which recomputes one chunk at a time)."""
    return config.memory.recompute and not config.memory.recompute_chunks


def expert_copy_bytes(model_config: ModelConfig, ep: int, sharded: bool) -> float:
    """Bytes of the bf16 copies of one rank's routed expert weights (gate_up [E/ep, 2I, D], down [E/ep, D, I])
    that each MoE chunk's grouped GEMMs save for the backward; none under FSDP2, whose gathered weights are
    bf16 already."""
    if sharded:
        return 0.0
    c = model_config
    return c.n_routed_experts / ep * 3 * c.hidden_size * c.moe_intermediate_size * 2


def recompute_held(
    config: TrainConfig, model_config: ModelConfig, layout: Layout, steps: ScaledTraces, a: Assumptions
) -> dict[str, float]:
    """Bytes each feed-forward module's recompute holds until its backward at the rank's tokens, where that
    is every chunk's saved tensors (`holds_every_chunk`; else none), so they grow with the rank's tokens
    rather than up to one chunk (`MOE_RULE`): as traced, on the line through the two traces, but for the
    MoE's bf16 expert-weight copies, one per chunk, counted per chunk of the layout (`expert_copy_bytes`),
    and with EP the rows the busiest rank receives beyond the mean (the traced rank computes the mean's,
    tokens x top-k), (imbalance - 1) x those rows x what the experts save per row."""
    if not holds_every_chunk(config):
        return {}
    lo, hi, tokens = steps.lo, steps.hi, steps.tokens
    chunk = config.model_options.moe_chunk_tokens

    def copies(t: int, ep: int, sharded: bool) -> float:
        return math.ceil(t / chunk) * expert_copy_bytes(model_config, ep, sharded)

    held = {}
    for key, at_t2 in hi.recomputed.items():
        if model_config.mlp_layer_types[int(key.split(".")[1])] != "sparse":
            held[key] = max(0.0, steps.line(lo.recomputed[key], at_t2))
            continue
        traced = steps.line(  # less the traced copies: every expert's (one rank), no FSDP
            lo.recomputed[key] - copies(steps.t1, 1, False), at_t2 - copies(steps.t2, 1, False)
        )
        busiest = 0.0
        if layout.ep > 1:
            busiest = (
                (a.sized_imbalance - 1) * tokens * model_config.num_experts_per_tok * hi.expert_row_bytes
            )
        held[key] = max(0.0, traced + copies(tokens, layout.ep, layout.sharded) + busiest)
    return held


def saved_activations(
    config: TrainConfig, model_config: ModelConfig, steps: ScaledTraces, host_inputs: float
) -> float:
    """Bytes the forward leaves for the backward: the traced layers' at the peak, plus what each untraced
    layer keeps until its backward, plus the layer inputs when traced offloaded but run with offload=false."""
    lo, hi = steps.lo, steps.hi
    untraced = [i for i in range(model_config.num_hidden_layers) if i not in steps.layers]
    kept_more = sum(steps.line(lo.kept[steps.rep_of[i]], hi.kept[steps.rep_of[i]]) for i in untraced)

    def live(trace: StepTrace) -> float:
        # what the feed-forward recompute holds belongs to that module's transient (`recompute_held`)
        held = trace.recomputed if holds_every_chunk(config) else {}
        largest = max((v + held.get(k, 0) for k, v in trace.transients.items()), default=0)
        return _categories(trace, "Activation", "Temp", "Other") - largest

    saved = steps.line(live(lo), live(hi)) + kept_more
    if TraceCache.traced_run(config).memory.offload and not config.memory.offload:
        saved += host_inputs  # the layer inputs stay on the device
    return saved


def state_categories(state: StateBytes, offloaded: bool) -> dict[str, float]:
    """One rank's device bytes of weights, gradients and optimizer state by category, named by what they hold
    (`OPTIMIZER_RULE`); none on the device with optimizer offload."""
    if state.optimizer in BF16_WEIGHTS:
        dtype = "bf16" if state.fp32_weights == 0 else "bf16, fp32-declared in fp32"
    else:
        dtype = "fp32"
    if state.optimizer == "adamw":
        moments = "optimizer state (AdamW, 2 x fp32)"
    else:
        moments = f"optimizer state (8-bit moments; {100 * state.unquantised:.2g}% of values unquantised)"
    kept = 0.0 if offloaded else 1.0
    return {
        f"parameters ({dtype})": kept * state.weights,
        f"gradients ({dtype})": kept * state.gradients,
        moments: kept * state.moments,
    }


def rank_memory(
    config: TrainConfig,
    model_config: ModelConfig,
    layout: Layout,
    params: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
    state: StateBytes,
) -> RankMemory:
    """One rank's device bytes by category and its node's host bytes (`SHARDING_RULE`, `OFFLOAD_RULE`), the
    weights, gradients and optimizer state as `state` counts them (`OPTIMIZER_RULE`)."""
    hi, opt_offload = steps.hi, layout.optimizer_offload
    transients = module_transients(config, model_config, layout, steps, a)
    host_inputs = (
        steps.line(steps.lo.host_bytes, hi.host_bytes) * model_config.num_hidden_layers / len(steps.layers)
    )
    held = state_categories(state, opt_offload)
    device = {
        **held,
        "buffers": _categories(hi, "Buffer") * params.total / sum(hi.param_numel.values()),
        "saved activations (all layers)": saved_activations(config, model_config, steps, host_inputs),
        "largest transient (module below)": max(transients.values(), default=0.0),
    }
    if layout.sharded:
        # the largest rank's shards hold ceil(dim0 / shards) rows (FSDP2 splits dim 0 as torch.chunk does)
        device[PADDING] = 0.0 if opt_offload else state.padding
        gathered, reduced = gathered_layers(config), reduce_bytes(config)
        dtype = "bf16" if reduced == 2 else "fp32"
        name = f"FSDP buffers ({gathered} bf16 layers gathered, bf16 + {dtype} gradient)"
        device[name] = _largest_layer(model_config, layout, params) * (2 * gathered + 2 + reduced)
        opt_phase = sum(device[k] for k in (*held, "buffers", PADDING))
    else:  # traced with torch's AdamW (the gradient sum, clipping and the step's temporaries), per parameter
        traced = hi.optimizer_peak_total * params.local / sum(hi.param_numel.values())
        # another optimizer: its weights, gradients and state in proportion to AdamW's (`OPTIMIZER_RULE`)
        opt_phase = traced * state.total / max(adamw_total(model_config, config, layout), 1.0)
    outside = outside_allocator(max(sum(device.values()), opt_phase), config.plan.gpu, a.case)
    device |= outside
    opt_phase += sum(outside.values())
    peak = max(sum(device.values()), opt_phase)
    device["optimizer step peak (separate phase)"] = opt_phase
    ranks_per_node = min(a.gpus_per_node, layout.world)
    host = {}
    if config.memory.offload:
        host["offloaded layer inputs (pinned)"] = host_inputs * ranks_per_node
    if opt_offload:  # a node's ranks together hold about the even share each (`StateBytes`)
        host[offload_name(state.optimizer)] = state.total * ranks_per_node
    return RankMemory(device, transients, host, host_inputs, peak, usable_gib(config))


PADDING = "FSDP padding (largest rank: ceil(dim0 / shards) rows)"


def reduce_bytes(config: TrainConfig) -> int:
    """Bytes per gradient value FSDP2 reduce-scatters in (`parallel.reduce_dtype`: fp32 4, bf16 2). The
    fp32-declared parameters (router, KDA decay, mHC: well under 1% of a layer) are reduced in fp32 whatever
    the setting; counted at the setting's bytes."""
    return 2 if config.parallel.reduce_dtype == "bf16" else 4


def gathered_layers(config: TrainConfig) -> int:
    """Decoder layers FSDP2 holds gathered at once: the running one and those gathered ahead, in the
    backward max(1, `fsdp_prefetch`) (its default prefetch of one), in the forward `fsdp_prefetch` (fewer or
    as many): 1 + max(1, fsdp_prefetch)."""
    return 1 + max(1, config.parallel.fsdp_prefetch)


def offload_name(optimizer: str) -> str:
    """The host category of the optimizer offload's weights, gradients and state."""
    if optimizer == "adamw":
        return "optimizer offload: fp32 parameters, gradients, AdamW (pinned)"
    weights = "bf16" if optimizer in BF16_WEIGHTS else "fp32"
    return f"optimizer offload: {weights} parameters, gradients, 8-bit moments (pinned)"


def adamw_total(model_config: ModelConfig, config: TrainConfig, layout: Layout) -> float:
    """Bytes of one rank's weights, gradients and AdamW state (the traced optimizer's)."""
    return state_bytes(model_config, config.model_options, "adamw", layout).total


def eval_transients(
    config: TrainConfig, model_config: ModelConfig, layout: Layout, steps: ScaledTraces, a: Assumptions
) -> dict[str, float]:
    """Each traced module's transient in the evaluator's forward at the rank's tokens (`chunked_transients`),
    the MoE layers' with EP plus the rows of one chunk the busiest rank receives beyond the traced mean and,
    with ep_overlap, the next chunk's rows in flight (`EVAL_RULE`)."""
    transients = chunked_transients(config, steps)
    if layout.ep == 1:
        return transients
    c = model_config
    chunk = min(steps.tokens, config.model_options.moe_chunk_tokens)
    rows = (a.imbalance - 1) * chunk * c.num_experts_per_tok
    width = 2 if eval_param_dtype(config) == torch.bfloat16 else 4  # the experts' compute dtype
    extra = rows * (2 * c.hidden_size + 3 * c.moe_intermediate_size) * width
    if config.parallel.ep_overlap and steps.tokens > chunk:  # the next chunk's dispatch: sent and received
        extra += (1 + a.imbalance) * chunk * c.num_experts_per_tok * c.hidden_size * width
    for k in transients:
        if k.endswith(".mlp") and c.mlp_layer_types[int(k.split(".")[1])] == "sparse":
            transients[k] += extra
    return transients


def eval_rank_memory(
    config: TrainConfig,
    model_config: ModelConfig,
    layout: Layout,
    stored: ParameterShare,
    steps: ScaledTraces,
    a: Assumptions,
) -> RankMemory:
    """One rank's device bytes in the evaluator's forward (`EVAL_RULE`); `stored`: the parameters' bytes as
    stored (`model_bytes`) and this rank's share. No host memory."""
    hi = steps.hi
    transients = eval_transients(config, model_config, layout, steps, a)
    starts = {k: steps.line(steps.lo.starts.get(k, 0), v) for k, v in hi.starts.items()}
    peak_module = max(transients, key=lambda k: starts.get(k, 0.0) + transients[k])
    dtype = "bf16, fp32 where declared" if eval_param_dtype(config) == torch.bfloat16 else "fp32"
    device = {
        f"parameters ({dtype})": stored.local,
        "buffers": _categories(hi, "Buffer") * stored.total / max(_categories(hi, "Parameter"), 1),
    }
    if layout.sharded:
        gathered = stored.numel["rest"] + 2 * _largest_layer(model_config, layout, stored)
        device["FSDP gathered: root (embedding, norm, head) + 2 decoder layers"] = gathered
    device["live as the peak's module starts (streams, inputs)"] = starts.get(peak_module, 0.0)
    device[f"transient of {peak_module}"] = transients[peak_module]
    device["per-token loss, all-gathered ([S] fp32)"] = (3 if layout.cp > 1 else 1) * config.seq_len * 4
    device |= outside_allocator(sum(device.values()), config.plan.gpu, a.case)
    return RankMemory(device, transients, {}, 0.0, sum(device.values()), usable_gib(config))


FRAGMENTATION = "allocator fragmentation (reserved over allocated at the peak)"
CONTEXT = "CUDA / NCCL context and workspaces (outside the allocator)"


def outside_allocator(allocated: float, gpu: str, case: str) -> dict[str, float]:
    """What the device holds beyond the allocated peak `allocated` (bytes), at `case`'s end of the range: the
    caching allocator's fragmentation (a share of the peak) and the CUDA / NCCL context (`rates.RATES`)."""
    return {
        FRAGMENTATION: rates.rate("fragmentation").on(gpu, case) * allocated,
        CONTEXT: rates.rate("context_gib").on(gpu, case),
    }


def _largest_layer(model_config: ModelConfig, layout: Layout, params: ParameterShare) -> float:
    """Parameters (or their bytes, as `params` counts them) of the largest decoder layer as FSDP gathers it
    (its routed experts / ep)."""
    layers = range(model_config.num_hidden_layers)
    sparse = [i for i in layers if model_config.mlp_layer_types[i] == "sparse"]
    experts_per_layer = params.experts / max(1, len(sparse))
    not_local = experts_per_layer - experts_per_layer / layout.ep  # the experts of the other ep ranks
    return max(params.numel[f"layers.{i}"] - not_local * (i in sparse) for i in layers)


def _categories(trace: StepTrace, *names: str) -> int:
    """Bytes of these MemTracker categories at the step's peak."""
    return sum(trace.step_peak.get(n, 0) for n in names)
