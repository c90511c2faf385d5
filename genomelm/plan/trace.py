"""One rank's share of a real training step, traced with torch's own tools (the measuring half of the
planner).

`trace_step` runs the trainer's own step (`genomelm.train.step.TrainStep.run`: `window_loss` with the
`LayerRunner`, context parallelism through `ParallelRun`, the gradient sum, clipping and the AdamW step) and
records:
- device memory by category with `torch.distributed._tools.mem_tracker.MemTracker` (the forward/backward peak
  and, unless `optimizer=False`, the optimizer-step peak, separately), what each decoder layer leaves live
  between its forward and its backward, each module's transient peak, and what each feed-forward module's
  recompute (in its layer's backward, with recompute) leaves live until its own backward;
- FLOPs per decoder layer with `torch.utils.flop_counter`'s formulas (those of `FlopCounterMode`; recompute
  included: what the GPU runs), the routed experts' grouped GEMMs also apart, and the bytes of every
  collective, both counted as dispatched in the same pass (one forward + backward per trace);
- apart from the step, what the routed experts save per row they compute (`expert_row_bytes`), for the rows
  an expert-parallel rank receives beyond the mean.
`trace_forward` measures the evaluator's forward the same way (the same model, mesh and instruments): the
window's per-token losses under `torch.no_grad()`, the parameters stored in the run's precision
(`eval_param_dtype`), through the context-parallel scorer (`ContextParallelScorer.loss`: shard, forward,
all-gather of the losses) when cp > 1; no `LayerRunner`, no optimizer.
On fake tensors each kernel switch left at "auto" (indexer, sparse attention, mHC) takes the GPU's Triton
kernel (`backends.as_on_gpu`): its custom op's fake implementation is traced, so the plan holds the kernel's
outputs and what it saves, not the torch path's transients (the torch paths when triton is not installed, with
a note). The KDA layers' memory is traced on the KDA torch path (`kda_backend="torch"`): fla's stand-ins
(`genomelm/plan/fla_stand_in.py`) know fla's outputs but not its workspace, and the torch path holds more
(per-chunk pairwise gate decays), so a plan of a GPU run's KDA layers is an upper bound. Their kernels (the op
classes and FLOPs the roofline costs) come from a second pass over the KDA layers alone on fla's route, as a
GPU runs them (`kda_backend` auto or fla): fla's conv, delta rule and context-parallel summary as the
stand-ins' custom ops, with fla's FLOP formulas and byte estimates (`_fla_kda_kernels`).
With `fake=True` everything runs on `FakeTensorMode` tensors
(no data, no compute) and, under context parallelism, on torch's fake process group ("fake" backend,
`FakeStore`): collectives trace without peers. With `fake=False` the same code runs on real tensors, on the
run's own dp x cp x ep mesh (the tests compare the plan of a layout with it).

Two substitutions, both exact for the trace: `torch.bincount` of expert ids (whose output length fake tensors
cannot know) returns its `minlength` (the ids are < n_routed_experts, so that is its length), and the host
copies of `offload=true` go to the meta device, so MemTracker counts them apart from the device (the host
side).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.model.backends import as_on_gpu, tracing_kernels
from genomelm.model.config import KDA
from genomelm.model.indexer import KERNEL_SCORE_BYTES, Indexer
from genomelm.model.moe import Experts
from genomelm.parallel.expert import received_tokens
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.training import ContextParallelScorer, ParallelRun
from genomelm.plan.fla_stand_in import fla_stand_in
from genomelm.plan.recording import (
    ExpertCountShape,
    MetaHostCopier,
    ModuleTracker,
    OpCounter,
    categories,
    flops_by_part,
    moments,
    numel_by_part,
    part_of,
    recomputed,
    snapshot_total,
    starts,
    transients,
)
from genomelm.plan.roofline import OpClass, SourceTags
from genomelm.run.config import OptimConfig, TrainConfig
from genomelm.run.precision import autocast_for, resolve_precision
from genomelm.train.memory import LayerRunner, set_chunk_recompute
from genomelm.train.optimizer import make_optimizer
from genomelm.train.step import StepPhases, TrainStep


@dataclass
class StepTrace:
    """What one rank's step held and did (bytes, FLOPs), for the traced layers."""

    tokens_per_rank: int
    cp: int
    layers: list[int]  # indices, in the full model, of the traced decoder layers
    param_numel: dict[str, int]  # "layers.<i>" per traced layer, "rest" (embedding, norm, head)
    step_peak: dict[str, int]  # forward + backward: bytes per category at the device peak
    optimizer_peak: dict[str, int]  # gradient sum (cp > 1), clip, AdamW step: bytes per category at the peak
    kept: dict[
        int, int
    ]  # traced layer index -> device bytes its forward leaves live until its backward (live
    # bytes as the next layer, or the final norm, starts minus as it starts: with offload, its input is gone)
    transients: dict[
        str, int
    ]  # module -> its peak minus the live bytes when it started (forward or backward)
    flops: dict[str, int]  # "layers.<i>" per traced layer and "rest"
    comm: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # "layers.<i>"/"rest" -> collective -> bytes
    host_bytes: int = 0  # offloaded to host memory during the step (peak)
    expert_flops: dict[str, int] = field(
        default_factory=dict
    )  # of `flops`, the routed experts' grouped GEMMs
    recomputed: dict[str, int] = field(
        default_factory=dict
    )  # "layers.<i>.mlp" -> bytes its recompute in the layer's backward left live: without recompute_chunks,
    # every chunk's saved tensors, held until the module's backward; absent without recompute
    expert_rows: dict[str, int] = field(
        default_factory=dict
    )  # "layers.<i>" -> (token, expert) rows this rank's experts computed (a real expert-parallel step)
    expert_row_bytes: int = 0  # what the routed experts save per row they compute (`expert_row_bytes`)
    starts: dict[str, int] = field(
        default_factory=dict
    )  # module (as in `transients`) -> activation, temporary and other bytes live as its first forward starts
    moments: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # module (as in `transients`) -> "innermost running module:function" ("" the module itself) -> its
    # forward's peak over its start while that code ran: the moments `chunked_transients` extrapolates apart
    ops: dict[str, dict[str, OpClass]] = field(
        default_factory=dict
    )  # "layers.<i>"/"rest"/"update" -> op class key -> its kernels (`genomelm.plan.roofline.OpLog`)

    @property
    def step_peak_total(self) -> int:
        return sum(self.step_peak.values())

    @property
    def optimizer_peak_total(self) -> int:
        return sum(self.optimizer_peak.values())


def reduced_layers(config: ModelConfig) -> list[int]:
    """The first layer of each (attention, feed-forward, indexer) kind, in model order."""
    seen: dict[tuple[str, str, str], int] = {}
    for i in range(config.num_hidden_layers):
        seen.setdefault(layer_kind(config, i), i)
    return sorted(seen.values())


def layer_kind(config: ModelConfig, i: int) -> tuple[str, str, str]:
    """(attention type, feed-forward type, indexer type) of layer i."""
    return config.layer_types[i], config.mlp_layer_types[i], config.indexer_types[i]


def sub_config(config: ModelConfig, layers: list[int]) -> ModelConfig:
    """The model config with only `layers` (in order), at the real widths."""
    return dataclasses.replace(
        config,
        num_hidden_layers=len(layers),
        layer_types=[config.layer_types[i] for i in layers],
        mlp_layer_types=[config.mlp_layer_types[i] for i in layers],
        indexer_types=[config.indexer_types[i] for i in layers],
    )


@contextmanager
def fake_process_group(cp: int, rank: int) -> Iterator[None]:
    """The default process group on torch's fake backend (collectives return at once, without peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def eval_precision(run: TrainConfig) -> str:
    """The precision the evaluation of `run` computes in on the GPUs it is planned for ("bf16" or "fp32";
    "auto" resolves as on CUDA)."""
    return resolve_precision(run.memory.precision, torch.device("cuda"))


def eval_param_dtype(run: TrainConfig) -> torch.dtype:
    """The dtype the evaluator stores the parameters in: bf16 for a bf16 run (the parameters the model
    declares fp32 stay fp32: `GlmForCausalLM.from_config` keeps them), else fp32."""
    return torch.bfloat16 if eval_precision(run) == "bf16" else torch.float32


@contextmanager
def _traced_model(
    run: TrainConfig,
    config: ModelConfig,
    tokens_per_rank: int,
    fake: bool,
    dtype: torch.dtype,
    recompute_chunks: bool,
    kda_backend: str = "torch",
) -> Iterator[tuple[GlmForCausalLM, ParallelRun | None, list[torch.Tensor]]]:
    """The model of `config` in `dtype` (each feed-forward chunk checkpointed on its own with
    `recompute_chunks`) split as the run splits it (without FSDP) and one window's rows (ids,
    labels, weights [1, cp x tokens_per_rank]): on fake tensors over a fake group of run.cp ranks (this
    being the last) with `fake`, else on real ones inside the run's own dp x cp x ep group (see
    `trace_step`). KDA on `kda_backend` ("fla": fla's stand-ins, fake tensors only)."""
    cp = run.parallel.cp
    dims = ParallelDims(1, cp, 1)
    with ExitStack() as stack:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            if cp > 1 and not dist.is_initialized():
                stack.enter_context(fake_process_group(cp, cp - 1))
        else:
            dims = ParallelDims(run.parallel.dp, cp, run.parallel.ep)
        # the mesh is built from real rank numbers, before any fake tensor exists
        parallel = ParallelRun.from_environment(dims, run.parallel.cp_layout, False, "cpu")
        options = dataclasses.replace(run.model_options, kda_backend=kda_backend)
        if kda_backend == "fla":
            stack.enter_context(fla_stand_in())
        if fake:
            stack.enter_context(FakeTensorMode())
            stack.enter_context(ExpertCountShape())
            stack.enter_context(tracing_kernels())
            options = as_on_gpu(options)[0]
        model = GlmForCausalLM.from_config(config, options, dtype)
        set_chunk_recompute(model, recompute_chunks)
        if parallel is not None:
            parallel.prepare(model, None, run.parallel.ep_capacity_factor, overlap=run.parallel.ep_overlap)
        window = tokens_per_rank * cp
        for indexer in (m for m in model.modules() if isinstance(m, Indexer)):
            # the indexer kernel's query blocks as at the run's window (the most queries whose scores fit its
            # byte bound there), so its scores grow linearly with the traced window, as the plan extrapolates
            indexer.kernel_score_bytes = KERNEL_SCORE_BYTES * window // max(run.seq_len, window)
        rows = [
            torch.zeros(1, window, dtype=torch.long),
            torch.zeros(1, window, dtype=torch.long),
            torch.ones(1, window),
        ]
        if not fake:
            rows[0] = torch.randint(0, min(config.vocab_size, 5), (1, window))
            rows[1] = torch.roll(rows[0], -1, dims=1)
        yield model, parallel, rows


def trace_step(
    run: TrainConfig,
    model_config: ModelConfig,
    tokens_per_rank: int,
    layers: list[int] | None = None,
    fake: bool = True,
    optimizer: bool = True,
) -> StepTrace:
    """Run one training step of one rank (`run`'s switches, bf16 autocast, window = cp x tokens_per_rank) over
    `layers` of the model (None: all) and measure it. The step is the trainer's own (`TrainStep.run` with a
    `ParallelRun` without FSDP, whose sharding the planner adds by arithmetic). With `fake`, the mesh is dp=1
    x cp (the planner adds dp and expert parallelism by arithmetic too: an expert exchange needs the other
    ranks' routing, which fake tensors do not have), and cp > 1 sets up a fake process group of run.cp ranks
    and traces its last rank. Without, the step is the run's own dp x cp x ep mesh (expert parallel when
    ep > 1), which must run inside a real group of dp*cp ranks (one process when all are 1): what the plan of
    that layout is checked against. `optimizer=False` leaves the update phase untracked (its bytes do not
    depend on the tokens)."""
    layers = list(range(model_config.num_hidden_layers)) if layers is None else layers
    config = sub_config(model_config, layers)
    trace = _step_trace(run, config, layers, tokens_per_rank, fake, optimizer, "torch")
    if fake:
        trace = _fla_kda_kernels(trace, run, model_config, tokens_per_rank, layers, forward_only=False)
    return dataclasses.replace(trace, expert_row_bytes=expert_row_bytes(config))


def trace_forward(
    run: TrainConfig,
    model_config: ModelConfig,
    tokens_per_rank: int,
    layers: list[int] | None = None,
    fake: bool = True,
) -> StepTrace:
    """Run the evaluator's forward of one window on one rank (window = cp x tokens_per_rank) over `layers` of
    the model (None: all) and measure it: the parameters in `eval_param_dtype`, `torch.no_grad()`, the run's
    autocast (`eval_precision`), the per-token losses (`reduction="none"`) through `ContextParallelScorer`
    at cp > 1 (this rank's shard, its forward, the all-gather of the losses, window order restored). The
    mesh as in `trace_step`; the trace has no optimizer phase, nothing recomputed and no expert rows saved."""
    layers = list(range(model_config.num_hidden_layers)) if layers is None else layers
    config = sub_config(model_config, layers)
    trace = _forward_trace(run, config, layers, tokens_per_rank, fake, "torch")
    if fake:
        trace = _fla_kda_kernels(trace, run, model_config, tokens_per_rank, layers, forward_only=True)
    return trace


def _step_trace(
    run: TrainConfig,
    config: ModelConfig,
    layers: list[int],
    tokens_per_rank: int,
    fake: bool,
    optimizer: bool,
    kda_backend: str,
    memory: bool = True,
) -> StepTrace:
    """`trace_step`'s step of `config` (the traced `layers` already cut out) with KDA on `kda_backend`; its
    kernels alone without `memory` (`_StepProbe`)."""
    chunks = run.memory.recompute_chunks
    with _traced_model(run, config, tokens_per_rank, fake, torch.float32, chunks, kda_backend) as traced:
        model, parallel, rows = traced
        model.train()
        runner = LayerRunner.for_memory(run.memory)
        if runner.copier is not None and fake:
            runner.copier = MetaHostCopier()
        return _measure(model, rows, runner, parallel, run, layers, tokens_per_rank, optimizer, memory)


def _forward_trace(
    run: TrainConfig,
    config: ModelConfig,
    layers: list[int],
    tokens_per_rank: int,
    fake: bool,
    kda_backend: str,
    memory: bool = True,
) -> StepTrace:
    """`trace_forward`'s forward of `config` (the traced `layers` already cut out) with KDA on
    `kda_backend`; its kernels alone without `memory` (`_StepProbe`)."""
    dtype = eval_param_dtype(run)
    with _traced_model(run, config, tokens_per_rank, fake, dtype, False, kda_backend) as traced:
        model, parallel, rows = traced
        model.eval()
        probe = _StepProbe(model, None, None, layers, optimizer=False, memory=memory)
        context = parallel.context if parallel is not None else None
        scorer = ContextParallelScorer(model, context) if context is not None else model
        with torch.no_grad(), autocast_for(eval_precision(run), probe.device), probe.tracked():
            scorer.loss(rows[0], rows[1], reduction="none")
        return probe.trace(tokens_per_rank, run.parallel.cp)


def _fla_kda_kernels(
    trace: StepTrace,
    run: TrainConfig,
    model_config: ModelConfig,
    tokens_per_rank: int,
    layers: list[int],
    forward_only: bool,
) -> StepTrace:
    """`trace` (traced with KDA on its torch path) with its KDA layers' kernels and FLOPs as a GPU runs them:
    from a pass over those layers alone on fla's route (fla's stand-ins), where the run's `kda_backend`
    takes fla on a GPU ("auto" or "fla"). The memory stays the torch path's (an upper bound)."""
    kda_layers = [i for i in layers if model_config.layer_types[i] == KDA]
    if not kda_layers or run.model_options.kda_backend not in ("auto", "fla"):
        return trace
    config = sub_config(model_config, kda_layers)
    if forward_only:
        fla = _forward_trace(run, config, kda_layers, tokens_per_rank, True, "fla", memory=False)
    else:
        fla = _step_trace(run, config, kda_layers, tokens_per_rank, True, False, "fla", memory=False)
    parts = [f"layers.{i}" for i in kda_layers]
    return dataclasses.replace(
        trace,
        ops=trace.ops | {part: fla.ops[part] for part in parts},
        flops=trace.flops | {part: fla.flops[part] for part in parts},
    )


def _measure(
    model: GlmForCausalLM,
    rows: list[torch.Tensor],
    runner: LayerRunner,
    parallel: ParallelRun | None,
    run: TrainConfig,
    layers: list[int],
    tokens_per_rank: int,
    optimizer: bool,
    memory: bool = True,
) -> StepTrace:
    """`TrainStep.run` of one window with the trackers around its two phases (forward + backward; the
    update)."""
    probe = _StepProbe(model, runner, run.optim, layers, optimizer, memory)
    step = TrainStep(
        model,
        probe.optimizer,
        probe.counting_runner,
        parallel,
        run.optim,
        lambda: torch.autocast(probe.device.type, dtype=torch.bfloat16),
        run.optim.grad_accum * (parallel.dims.dp if parallel is not None else 1),
    )
    step.run(run.optim.lr, [rows], StepPhases(probe.tracked, probe.update, assume_finite=True))
    return probe.trace(tokens_per_rank, parallel.dims.cp if parallel is not None else 1)


class _StepProbe:
    """The planner's instruments on one traced step: MemTracker over the forward + backward and, apart, over
    the update; the live bytes as each decoder layer (and the final norm) starts; FLOPs and collective bytes
    by decoder layer (`OpCounter`). Without a `runner` and `optim` (the evaluator's forward): no optimizer,
    and the layers' starts marked by forward pre-hooks. Without `memory` (fla's pass over the KDA layers,
    whose bytes the plan takes from the torch path): the counter alone, told the running layer by the
    tracker's module hooks (torch's `ModTracker`); the trace's byte fields are then empty."""

    def __init__(
        self,
        model: GlmForCausalLM,
        runner: LayerRunner | None,
        optim: OptimConfig | None,
        layers: list[int],
        optimizer: bool,
        memory: bool = True,
    ) -> None:
        self.model, self.runner, self.layers, self.track_update = model, runner, layers, optimizer
        self.memory = memory
        self.device = torch.device("cpu")
        self.optimizer = make_optimizer(model, optim, self.device) if optim is not None else None
        self.names = {layer: f"layers.{layers[i]}" for i, layer in enumerate(model.layers)}
        self.tracker, self.update_tracker = ModuleTracker(), ModuleTracker()
        self.tracker.track_external(model, *([self.optimizer] if self.optimizer is not None else []))
        self.counter = OpCounter(self.where)
        self.marks: list[int] = []  # live device bytes as each layer starts, and as the final norm starts
        self.in_forward = True
        self.handles = [model.norm.register_forward_pre_hook(self.end_of_forward)]
        if runner is None:
            hooks = [layer.register_forward_pre_hook(lambda *_: self.mark()) for layer in model.layers]
            self.handles += hooks

    def mark(self) -> None:
        if self.in_forward and self.memory:
            self.marks.append(snapshot_total(self.tracker, self.device))

    def counting_runner(self, layer: nn.Module, hidden: torch.Tensor, selection: Any) -> Any:
        self.mark()
        return self.runner(layer, hidden, selection)

    def end_of_forward(self, _module: nn.Module, _args: Any) -> None:
        self.mark()
        self.in_forward = False  # the final norm starts: what follows is the head, the loss and the backward

    def where(self) -> str:
        """The traced decoder layer whose forward, recompute or backward runs now, else "rest"."""
        for parent in self.tracker._mod_tracker.parents:
            for layer, name in self.names.items():
                if parent == f"GlmForCausalLM.layers.{layer.layer_idx}":
                    return name
        return "rest"

    @contextmanager
    def tracked(self) -> Iterator[None]:
        """The forward (and backward) under the memory tracker (its module hooks alone without `memory`) and
        the counter."""
        with self.tracker if self.memory else self.tracker._mod_tracker, self.counter, SourceTags():
            yield

    @contextmanager
    def update(self) -> Iterator[None]:
        """The gradient sum (cp > 1), clipping and the AdamW step, tracked apart; untraced without
        `optimizer` (its bytes and collectives do not depend on the tokens)."""
        if not self.track_update:
            yield
            return
        self.update_tracker.track_external(self.model, self.optimizer)  # after the backward: gradients exist
        self.counter.updating = True
        try:
            with self.update_tracker, self.counter:
                yield
        finally:
            self.counter.updating = False

    def trace(self, tokens_per_rank: int, cp: int) -> StepTrace:
        """What the step held and did, once it has run (what it did alone without `memory`)."""
        for handle in self.handles:
            handle.remove()
        device, layers, names = self.device, self.layers, self.names
        kernels = StepTrace(
            tokens_per_rank=tokens_per_rank,
            cp=cp,
            layers=layers,
            param_numel=numel_by_part(self.model, names),
            step_peak={},
            optimizer_peak={},
            kept={},
            transients={},
            flops=flops_by_part(self.counter, names),
            comm=self.counter.bytes,
            expert_flops=self.counter.expert_flops,
            ops=self.counter.ops.parts,
            expert_rows={
                part_of(name, names).removesuffix(".mlp.experts"): rows
                for name, rows in received_tokens(self.model, reset=False).items()
            },
        )
        if not self.memory:
            return kernels
        peaks = self.tracker.get_tracker_snapshot("peak")
        host = peaks.get(torch.device("meta"), {}).get("Total", 0)
        copier = self.runner.copier if self.runner is not None else None
        if copier is not None and not isinstance(copier, MetaHostCopier):
            host = copier.bytes_offloaded
        update_peak = self.update_tracker.get_tracker_snapshot("peak").get(device, {})
        return dataclasses.replace(
            kernels,
            step_peak=categories(peaks.get(device, {})),
            optimizer_peak=categories(update_peak) if self.track_update else {},
            kept={layers[i]: self.marks[i + 1] - self.marks[i] for i in range(len(layers))},
            transients=transients(self.tracker, device, names),
            moments=moments(self.tracker, names),
            starts=starts(self.tracker, device, names),
            host_bytes=host,
            recomputed=recomputed(self.tracker, device, names),
        )


def expert_row_bytes(config: ModelConfig, rows: int = 64) -> int:
    """Bytes the routed experts' grouped GEMMs and SwiGLU (`Experts.expert_rows`, what every rank runs on the
    rows it receives) save for the backward per (token, expert) row, measured on fake tensors: the difference
    between `rows` and 2 x `rows` bf16 rows (which leaves out the weights' bf16 copies)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def saved(experts: Experts, n: int) -> int:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # by storage (fake ones have no data pointer)
            return tensor

        x = torch.empty(n, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            experts.expert_rows(x, torch.zeros(config.n_routed_experts, dtype=torch.long))
        return sum(storages.values())

    with FakeTensorMode():
        experts = Experts(config)
        return (saved(experts, 2 * rows) - saved(experts, rows)) // rows


@contextmanager
def real_step(run: TrainConfig, model_config: ModelConfig, tokens: int) -> Iterator[Callable[[], float]]:
    """A function that runs one real training step of one rank (`trace_step`'s step, fake=False, in one
    process) with no instrument around it and returns its seconds: what a roofline of `trace_step`'s op
    list is checked against on this machine. Its first call warms up."""
    with _traced_model(run, model_config, tokens, False, torch.float32, run.memory.recompute_chunks) as (
        model,
        parallel,
        rows,
    ):
        model.train()
        step = TrainStep(
            model,
            make_optimizer(model, run.optim, torch.device("cpu")),
            LayerRunner.for_memory(run.memory),
            parallel,
            run.optim,
            lambda: torch.autocast("cpu", dtype=torch.bfloat16),
            run.optim.grad_accum,
        )

        def timed() -> float:
            start = time.perf_counter()
            step.run(run.optim.lr, [rows])
            return time.perf_counter() - start

        yield timed
