"""The multi-GPU training step and the evaluator's forward, simulated on this CPU: every rank's
`TrainStep.run` (or `score_windows` of one window) on fake CUDA tensors, its collectives checked against
NCCL's rules and compared across ranks, its host syncs counted.

`simulate_step(config)` runs, in one fake-CUDA process (`genomelm.parallel.fake_cuda`), each rank of the
run's dp x cp mesh in turn (ep borrowing its ranks) on torch's fake process group: the model built on
`cuda`, split by the trainer's own `ParallelRun.prepare` (context and expert parallelism), the trainer's
`LayerRunner` and optimizer, one optimizer step of `grad_accum` windows per dp rank through the trainer's own
`TrainStep.run`, all inside `genomelm.parallel.simulation.SimulationMode`. The CUDA branches of the code run
(`device.type == "cuda"`, bf16 autocast on cuda, the grouped GEMM at the GPU's compute capability), so a CPU
tensor handed to a collective, a collective one rank skips, or a host sync in the hot path shows here as it
would on the first GPU step.

`simulate_eval_step(config)` does the same for the evaluator (`genomelm eval` on the run's mesh): each rank's
`ScoringRun.from_environment`, `build_scoring_model` (built on meta, split by `ParallelRun.prepare` with
FSDP2, stored in the run's precision, placed on the device), the `ContextParallelScorer` under cp, and
`score_windows` of one window (its forward, the context cut's, the dp replicas' pass counter), forward only.

What the simulation cannot see, and what stands in for it:
- values: fake tensors hold none; the routing is balanced (every expert receives its share), a loss or norm
  read returns a placeholder, the step is taken as finite; the evaluator's `.numpy()` of a loss read back to
  the host gives zeros (`stand_ins.host_numpy`: the read-back itself, `.cpu()`, is recorded as the sync it
  is);
- kernels: fla's and any Triton kernel cannot run on fake tensors. fla's `chunk_kda` (with and without its
  in-kernel gate) and `causal_conv1d` enter as custom ops with fake implementations (`fla_stand_in`, in
  `genomelm/plan/fla_stand_in.py`:
  outputs and final state of the right shapes and dtypes, fla's saved inputs, gradients of the inputs'
  shapes), so KDA takes the route it takes on a GPU (`auto` -> fla: the conv, the context-parallel summary
  and the delta rule on fla's kernels) whether or not fla is installed here;
- FSDP2 (the evaluation only): its side streams and events need the CUDA runtime, so
  `stand_ins.fsdp_stand_in` gives it streams that only keep their order (no timing; a host wait on one is
  recorded as a sync) and builds its device meshes' rank tables as the host tensors they are. The training
  step's simulated mesh runs without FSDP (`fsdp=false`: the replicated gradients' all-reduce stands in for
  its reduce-scatters), its FSDP2 collectives counted on gloo instead (tests/test_parallel_fsdp.py);
- the evaluator's results gather (`all_gather_object` of pickled numpy arrays over the dp group, once per
  evaluation after the last window): it needs the values, so the simulated path stops right before it;
- NCCL's timing, real overlap, kernel-internal behaviour and memory fragmentation.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from genomelm.data.vocab import BUILTIN, A
from genomelm.data.windows import Window
from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.model.backends import as_on_gpu
from genomelm.model.config import MOE
from genomelm.parallel.expert_slots import placements_by_module
from genomelm.parallel.fake_cuda import run_on_fake_cuda
from genomelm.parallel.layout import ContextLayout, segments_per_rank
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.placement import Placement, placement_with_replicas, zipf_load
from genomelm.parallel.simulation import (
    Collective,
    HostSync,
    SimulationMode,
    check_ranks_agree,
)
from genomelm.parallel.training import ContextParallelScorer, ParallelRun
from genomelm.plan.fla_stand_in import fla_stand_in, replaced
from genomelm.plan.stand_ins import (
    fsdp_stand_in,
    host_numpy,
    until_results_gather,
)
from genomelm.plan.trace import reduced_layers, sub_config
from genomelm.run import scoring
from genomelm.run.config import TrainConfig
from genomelm.run.models import device_rows
from genomelm.run.precision import fsdp_param_dtype
from genomelm.run.scoring import (
    ScoringRun,
    build_scoring_model,
    context_cut_tokens,
    score_windows,
    scoring_dtype,
)
from genomelm.train.memory import LayerRunner, set_chunk_recompute
from genomelm.train.optimizer import make_optimizer
from genomelm.train.step import StepPhases, TrainStep

GPU_CAPABILITY = {"b200": (10, 0), "h200": (9, 0), "h100": (9, 0)}
EXCHANGE_SYNC_SITE = "in _exchange_sizes"  # where the expert exchanges read their split sizes


def simulates_cuda(config: TrainConfig) -> bool:
    """Whether `genomelm plan` simulates the step on fake CUDA (`device=cuda`, or `auto`)."""
    return config.plan.device in ("auto", "cuda")


@dataclass
class RankSimulation:
    """What one simulated rank's step issued: its collectives and host syncs (in order), its windows."""

    rank: int
    windows: int
    collectives: list[Collective]
    syncs: list[HostSync]
    unknown_values: int  # value reads the simulation answered with a placeholder
    routes: str = ""  # the model's route table as it ran (the kernels each block took)
    parameter_bytes: dict[str, int] = field(default_factory=dict)  # evaluation: bytes stored per dtype


@dataclass
class Simulation:
    """Every simulated rank of one optimizer step (`stage` "train") or of one evaluated window ("eval": its
    forward of `tokens_per_window` tokens, then with `cut_tokens` the context cut's forward of that many)."""

    dims: ParallelDims
    tokens_per_window: int
    ranks: list[RankSimulation] = field(default_factory=list)
    stage: str = "train"
    cut_tokens: int = 0

    def expert_syncs_per_window(self, model_config: ModelConfig) -> int:
        """Host syncs the expert exchanges need per micro-batch (or evaluated window): one per MoE layer per
        forward, which reads the split sizes of all the layer's chunks at once (`plan_expert_chunks`); a
        recompute reuses the forward's."""
        layers = sum(kind == MOE for kind in model_config.mlp_layer_types)
        forwards = sum(1 for tokens in (self.tokens_per_window, self.cut_tokens) if tokens)
        return layers * forwards if self.dims.ep > 1 else 0

    def syncs_per_window(self) -> dict[str, float]:
        """Host syncs per micro-batch (forward + backward of one window) by "kind at site", the busiest
        rank's."""
        best: dict[str, float] = {}
        for rank in self.ranks:
            counts = Counter(f"{s.kind} at {s.site}" for s in rank.syncs if s.phase == "window")
            total = sum(counts.values()) / max(rank.windows, 1)
            if total >= sum(best.values()):
                best = {key: n / max(rank.windows, 1) for key, n in counts.items()}
        return best

    def syncs_per_update(self) -> dict[str, int]:
        """Host syncs of the update phase (gradient sum, clipping, AdamW) by "kind at site", rank 0's."""
        return dict(Counter(f"{s.kind} at {s.site}" for s in self.ranks[0].syncs if s.phase == "update"))

    def collectives_by_kind(self, rank: int = 0, phase: str | None = None) -> dict[str, tuple[int, int]]:
        """(count, bytes) per "kind over group-size ranks" of one rank's step (of its `phase` only, if
        given)."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.ranks[rank].collectives:
            if phase is not None and c.phase != phase:
                continue
            key = f"{c.kind} ({c.dtype}) over {len(c.ranks)} ranks"
            count, size = out.get(key, (0, 0))
            out[key] = (count + 1, size + c.bytes)
        return out

    def started_ahead(self, rank: int = 0, phase: str | None = None) -> dict[str, tuple[int, int]]:
        """(started without waiting, all) collectives per kind of one rank's step (of its `phase` only, if
        given): those left running on NCCL's stream beside the compute (`async_op`), e.g. the expert
        exchanges with `ep_overlap`."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.ranks[rank].collectives:
            if phase is not None and c.phase != phase:
                continue
            ahead, total = out.get(c.kind, (0, 0))
            out[c.kind] = (ahead + c.started_ahead, total + 1)
        return out


def _started_ahead_line(simulation: Simulation, phase: str | None = None) -> str:
    """The description's line of the collectives the last rank started without waiting, by kind."""
    ahead = simulation.started_ahead(len(simulation.ranks) - 1, phase)
    return (
        "  started without waiting (on NCCL's stream beside the compute, waited for where used): "
        + ", ".join(f"{kind} {n} of {total}" for kind, (n, total) in ahead.items())
    )


def simulate_step(
    config: TrainConfig,
    model_config: ModelConfig,
    ranks: list[int] | None = None,
    gpu: str = "h200",
    timeout_s: float = 600.0,
) -> Simulation:
    """One optimizer step of `config`'s mesh on fake CUDA tensors, rank by rank (`ranks`: None, all), with
    the collectives of the ranks compared (`check_ranks_agree`) when all ran. Raises `CollectiveError` at the
    first collective NCCL would reject."""
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    dims.check(model_config.n_routed_experts if MOE in model_config.mlp_layer_types else None)
    ranks = list(range(dims.world)) if ranks is None else ranks
    simulation = run_on_fake_cuda(_simulate_ranks, config, model_config, ranks, gpu, timeout_s=timeout_s)
    if len(ranks) == dims.world:
        check_ranks_agree([r.collectives for r in simulation.ranks])
    return simulation


@contextmanager
def simulated_gpu(gpu: str) -> Iterator[None]:
    """What the CUDA runtime would answer about the device (capability, autocast availability), on the
    fake-CUDA process's torch."""
    capability = GPU_CAPABILITY[gpu]
    import torch.cuda.amp.common as amp
    from torch.utils.checkpoint import DefaultDeviceType

    cuda = torch.cuda
    answers = {
        "get_device_capability": lambda device=None: capability,
        "is_bf16_supported": lambda including_emulation=True: True,
        "current_device": lambda: 0,
    }
    saved = {name: getattr(cuda, name) for name in answers}
    saved_amp = amp.amp_definitely_not_available
    saved_checkpoint_device = DefaultDeviceType._default_device_type
    for name, answer in answers.items():
        setattr(cuda, name, answer)
    amp.amp_definitely_not_available = lambda: False
    # checkpoint's recompute restores the autocast of this device type (on a GPU machine: the accelerator's)
    DefaultDeviceType.set_device_type("cuda")
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cuda, name, original)
        amp.amp_definitely_not_available = saved_amp
        DefaultDeviceType._default_device_type = saved_checkpoint_device


def on_gpu_kernels(config: TrainConfig) -> TrainConfig:
    """`config` with its kernel switches as a GPU resolves them (`backends.as_on_gpu`): the Triton kernels'
    custom ops (their fake implementations) where triton is installed, else their torch paths (the plan's
    notes say so)."""
    return dataclasses.replace(config, model_options=as_on_gpu(config.model_options)[0])


def _simulate_ranks(config: TrainConfig, model_config: ModelConfig, ranks: list[int], gpu: str) -> Simulation:
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    simulation = Simulation(dims, config.seq_len)
    config = on_gpu_kernels(config)
    with simulated_gpu(gpu), fla_stand_in():
        for rank in ranks:
            simulation.ranks.append(_simulate_rank(config, model_config, dims, rank))
    return simulation


def _simulate_rank(
    config: TrainConfig, model_config: ModelConfig, dims: ParallelDims, rank: int
) -> RankSimulation:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device("cuda", 0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
    try:
        parallel = ParallelRun.from_environment(dims, config.parallel.cp_layout, False, device.type)
        phase = ["build"]
        mode = SimulationMode("cuda", lambda: phase[0])
        options = config.model_options
        with FakeTensorMode(), mode:
            model = GlmForCausalLM.from_config(model_config, options, device=device)
            set_chunk_recompute(model, config.memory.recompute_chunks)
            if parallel is not None:
                param_dtype = fsdp_param_dtype(config.memory.precision, device)
                parallel.prepare(
                    model,
                    param_dtype,
                    config.parallel.ep_capacity_factor,
                    overlap=config.parallel.ep_overlap,
                    placements=simulated_placements(config, model, model_config),
                )
            model.train()
            runner = LayerRunner.for_memory(config.memory, offload=False)
            # torch's AdamW whatever the run's optimizer: torchao's quantiser reads values (data-dependent
            # on fake tensors), and the low-bit update, elementwise on each rank's own shards, has no
            # collective and no host sync (tests/test_optimizers.py; benchmarks/gpu_check.py on a GPU)
            optimizer = make_optimizer(model, dataclasses.replace(config.optim, optimizer="adamw"), device)
            step = TrainStep.for_run(config, model, optimizer, runner, parallel, device)
            windows = _windows(config, device, phase)
            phases = StepPhases(update=lambda: _phase(phase, "update"), assume_finite=True)
            step.run(config.optim.lr, windows, phases)
        return RankSimulation(
            rank,
            config.optim.grad_accum,
            mode.collectives,
            mode.syncs,
            mode.unknown_values,
            model.route_table(),
        )
    finally:
        dist.destroy_process_group()


def simulated_placements(
    config: TrainConfig, model: GlmForCausalLM, model_config: ModelConfig
) -> dict[str, Placement]:
    """With `expert_placement=balanced`, where the ranks place the experts: a run places them by its own load
    at resume, the simulation by a skewed one (each MoE layer its own Zipf load, s=2: one expert takes most
    rows, so `expert_copies` slots hold copies), so the placed exchange and the copies' run as on a GPU.
    {}: the static blocks."""
    ep = config.parallel.ep
    if config.parallel.expert_placement != "balanced" or ep == 1:
        return {}
    experts, copies = model_config.n_routed_experts, config.parallel.expert_copies
    layers = [i for i, kind in enumerate(model_config.mlp_layer_types) if kind == MOE]
    placed = {i: placement_with_replicas(zipf_load(experts, 2.0, seed=i), ep, copies) for i in layers}
    return placements_by_module(model, placed)


def _windows(config: TrainConfig, device: torch.device, phase: list[str]) -> Iterator[list[torch.Tensor]]:
    """This rank's windows of the step as the loop hands them over (host tensors moved to the device)."""
    for _ in range(config.optim.grad_accum):
        phase[0] = "input"
        rows = [torch.zeros(config.seq_len, dtype=torch.long)] * 2 + [torch.ones(config.seq_len)]
        moved = device_rows(rows, device)
        phase[0] = "window"
        yield moved


@contextmanager
def _phase(phase: list[str], name: str) -> Iterator[None]:
    phase[0] = name
    yield


def simulate_eval_step(
    config: TrainConfig,
    model_config: ModelConfig,
    ranks: list[int] | None = None,
    gpu: str = "h200",
    timeout_s: float = 600.0,
) -> Simulation:
    """The evaluator's scoring of one window of `config.seq_len` tokens on `config`'s mesh, on fake CUDA
    tensors, rank by rank (`ranks`: None, all): the model built and split as `load_scoring_model` does it
    (phase "build"), then `score_windows` of the window (phase "window": its forward, and with
    `eval.context_cut` and >= 2 buckets of `eval.bucket` tokens the context cut's, under the run's autocast
    and `no_grad`; the dp replicas' pass counter), up to the results' gather (see the module docstring). The
    ranks' collectives are compared (`check_ranks_agree`) when all ran; `CollectiveError` at the first
    collective NCCL would reject.

    Not simulated: reading the weights (`load_rank_shard`, `load_sharded_model`: values only, which fake
    tensors do not hold) and the results' `all_gather_object` after the last window."""
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    dims.check(model_config.n_routed_experts if MOE in model_config.mlp_layer_types else None)
    ranks = list(range(dims.world)) if ranks is None else ranks
    simulation = run_on_fake_cuda(_simulate_eval_ranks, config, model_config, ranks, gpu, timeout_s=timeout_s)
    if len(ranks) == dims.world:
        check_ranks_agree([r.collectives for r in simulation.ranks])
    return simulation


def _simulate_eval_ranks(
    config: TrainConfig, model_config: ModelConfig, ranks: list[int], gpu: str
) -> Simulation:
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    cut = context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut)
    simulation = Simulation(dims, config.seq_len, stage="eval", cut_tokens=cut)
    config = on_gpu_kernels(config)
    with simulated_gpu(gpu), fla_stand_in():
        for rank in ranks:
            simulation.ranks.append(_simulate_eval_rank(config, model_config, dims, rank, cut > 0))
    return simulation


def _simulate_eval_rank(
    config: TrainConfig, model_config: ModelConfig, dims: ParallelDims, rank: int, context_cut: bool
) -> RankSimulation:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device("cuda", 0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
    try:
        with replaced(scoring, "run_device", lambda: device):  # what `run_device` answers on a GPU rank
            run = scoring.ScoringRun.from_environment(config)
        phase = ["build"]
        mode = SimulationMode("cuda", lambda: phase[0])
        with FakeTensorMode(), mode, fsdp_stand_in(mode), host_numpy():
            scorer, model = _scoring_model(model_config, config, run)
            stored: Counter[str] = Counter()
            for param in model.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
                stored[str(local.dtype).removeprefix("torch.")] += local.numel() * local.element_size()
            # a held-out window as the dataset reads it (host memory, pageable): one base throughout, so
            # every position but the last has a label
            seq = config.seq_len
            ids = torch.full((seq,), BUILTIN.code_to_id[A], dtype=torch.long)
            softmask = torch.zeros(seq, dtype=torch.bool)
            window = Window(
                "simulated", 0, "simulated", start=0, end=seq, ids=ids, softmask=softmask, vocab=BUILTIN
            )
            phase[0] = "window"
            with until_results_gather():
                score_windows(
                    scorer,
                    [window],
                    config.eval.bucket,
                    context_cut,
                    precision=config.memory.precision,
                    share=run.share,
                )
        return RankSimulation(
            rank, 1, mode.collectives, mode.syncs, mode.unknown_values, model.route_table(), dict(stored)
        )
    finally:
        dist.destroy_process_group()


def _scoring_model(
    model_config: ModelConfig, config: TrainConfig, run: ScoringRun
) -> tuple[nn.Module, GlmForCausalLM]:
    """`load_scoring_model`'s model on `run` without its weights (what would fill them writes values only):
    the scorer (`ContextParallelScorer` under cp, else the model) and the model.

    With FSDP2 it is `build_scoring_model`'s (built on meta, split, `to_empty` on the device). Without it the
    model is built on the device and then split, as `load_scoring_model` does for a preset: the same split,
    but `to_empty` cannot move a fake parameter without FSDP2 replacing it (torch swaps the tensors, and
    refuses the parameters `FakeTensorMode` holds weak references to)."""

    if run.parallel is not None and run.parallel.fsdp:
        model = build_scoring_model(model_config, config, run)
    else:
        dtype = scoring_dtype(config.memory.precision, run.device)
        model = GlmForCausalLM.from_config(model_config, config.model_options, dtype, run.device)
        if run.parallel is not None:
            param_dtype = fsdp_param_dtype(config.memory.precision, run.device)
            run.parallel.prepare(
                model, param_dtype, config.parallel.ep_capacity_factor, overlap=config.parallel.ep_overlap
            )
    model.eval()
    context = run.parallel.context if run.parallel is not None else None
    return (ContextParallelScorer(model, context) if context is not None else model), model


def _full_size_syncs(
    simulation: Simulation, full_sim: Simulation, traced: ModelConfig, full: ModelConfig
) -> tuple[int, float, float]:
    """(the expert exchanges' syncs at the whole model's size, the simulated ones per MoE layer forward, all
    host syncs per window at full size): the simulated exchange syncs scaled from the `traced` layers to
    `full`'s, the rest as simulated."""
    syncs = simulation.syncs_per_window()
    traced_calls = simulation.expert_syncs_per_window(traced)
    full_calls = full_sim.expert_syncs_per_window(full)
    exchange = sum(n for site, n in syncs.items() if EXCHANGE_SYNC_SITE in site)
    per_call = exchange / traced_calls if traced_calls else 0.0
    return full_calls, per_call, sum(syncs.values()) - exchange + per_call * full_calls


def describe_simulation(
    simulation: Simulation, config: TrainConfig, traced: ModelConfig, full: ModelConfig
) -> str:
    """The simulated step as the planner prints it: collectives per step by kind and group, host syncs per
    micro-batch by site, as simulated (the `traced` layers) and at the whole model's size. An evaluation's
    simulation (`simulate_eval_layout`) is described as the evaluator's forward (`_describe_eval`)."""
    if simulation.stage == "eval":
        return _describe_eval(simulation, config, traced, full)
    rank = simulation.ranks[-1]
    syncs = simulation.syncs_per_window()
    full_calls, per_call, projected = _full_size_syncs(
        simulation, Simulation(simulation.dims, config.seq_len), traced, full
    )
    dims = simulation.dims
    lines = [
        f"simulated step on fake CUDA (rank {rank.rank} of dp {dims.dp} x cp {dims.cp}, ep {dims.ep}; "
        f"{traced.num_hidden_layers} of {full.num_hidden_layers} layers, "
        f"{simulation.tokens_per_window // simulation.dims.cp:,} tokens per rank; FSDP not simulated):",
        "  collectives NCCL would reject: 0 (each is checked: device, contiguity, dtype)",
        "  collectives per step (simulated layers), by kind and group:",
    ]
    by_kind = simulation.collectives_by_kind(len(simulation.ranks) - 1)
    lines += [f"    {kind:<58} {n:>5} x {size / 1e6:>10,.2f} MB" for kind, (n, size) in by_kind.items()]
    lines.append(_started_ahead_line(simulation))
    lines.append(
        f"  host syncs per micro-batch: {sum(syncs.values()):g} simulated; {projected:g} at the full model "
        f"({full_calls} MoE layer forwards x {per_call:g} + the rest: the expert exchanges' split sizes, all "
        "of a layer's chunks at once, inherent; a recompute reuses the forward's)"
    )
    lines += [f"    {n:>6g}  {site}" for site, n in sorted(syncs.items(), key=lambda item: -item[1])]
    inputs = Counter(f"{s.kind} at {s.site}" for s in rank.syncs if s.phase == "input")
    lines.append(
        f"  before each micro-batch (the window's rows to the device, through pinned memory): "
        f"{sum(inputs.values())}"
    )
    update = simulation.syncs_per_update()
    lines.append(
        f"  per optimizer step, after the micro-batches: {sum(update.values())} simulated, + 1 read of the "
        "step's loss and gradient norm (one copy; the simulated step is taken as finite, so it is not read)"
    )
    lines += [f"    {n:>6}  {site}" for site, n in update.items()]
    return "\n".join(lines)


def simulate_layout(
    config: TrainConfig, model_config: ModelConfig, gpu: str
) -> tuple[Simulation, ModelConfig]:
    """The planner's simulation of the run's own layout: the last rank of the mesh (the one `genomelm plan`
    traces), one decoder layer of each kind at the real widths, at `trace_tokens` tokens per rank (or the
    rank's own, if fewer; rounded to whole KDA chunks and k-pools of every segment), the expert GEMMs in
    bf16. Returns the simulation and the traced model config."""

    cp = config.parallel.cp
    unit = segments_per_rank(config.parallel.cp_layout) * 64 * model_config.index_kpool
    tokens = max(min(config.seq_len // cp, config.plan.trace_tokens) // unit * unit, unit)
    ContextLayout(tokens * cp, cp, 0, config.parallel.cp_layout, kpool=model_config.index_kpool)
    traced = sub_config(model_config, reduced_layers(model_config))
    world = config.parallel.dp * cp
    # the expert GEMMs in bf16: torchao's FP8 / MXFP8 kernels do not run on fake CUDA (their order of work,
    # with no host sync or host tensor added, is tests/test_simulation.py's, the kernels stood in for)
    run = config.replace(seq=str(tokens * cp), grad_accum=1, expert_precision="bf16")
    return simulate_step(run, traced, ranks=[world - 1], gpu=gpu), traced


def _describe_eval(
    simulation: Simulation, config: TrainConfig, traced: ModelConfig, full: ModelConfig
) -> str:
    """The simulated evaluation (one window: its forward and the context cut's) as the planner prints it:
    the parameters a rank stores, collectives per window by kind and group, host syncs per window by site, as
    simulated and at the whole model's size (`config`: the run's, at its own window and bucket)."""
    rank = simulation.ranks[-1]
    dims = simulation.dims
    syncs = simulation.syncs_per_window()
    full_cut = context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut)
    full_sim = Simulation(dims, config.seq_len, stage="eval", cut_tokens=full_cut)
    full_calls, per_call, projected = _full_size_syncs(simulation, full_sim, traced, full)
    forwards = f"{simulation.tokens_per_window // dims.cp:,} tokens per rank"
    if simulation.cut_tokens:
        forwards += f", then the context cut's {simulation.cut_tokens // dims.cp:,}"
    stored = ", ".join(
        f"{dtype} {size / 1e6:,.2f} MB" for dtype, size in sorted(rank.parameter_bytes.items())
    )
    lines = [
        f"simulated evaluation forward on fake CUDA (rank {rank.rank} of dp {dims.dp} x cp {dims.cp}, ep "
        f"{dims.ep}; {traced.num_hidden_layers} of {full.num_hidden_layers} layers; one window: {forwards}; "
        f"forward only, FSDP2 {'on' if config.parallel.fsdp and dims.world > 1 else 'off'}, the weights not "
        "read):",
        "  collectives NCCL would reject: 0 (each is checked: device, contiguity, dtype)",
        f"  parameters this rank stores (simulated layers): {stored or 'none'}",
        "  collectives per window (simulated layers), by kind and group:",
    ]
    by_kind = simulation.collectives_by_kind(len(simulation.ranks) - 1, "window")
    lines += [f"    {kind:<58} {n:>5} x {size / 1e6:>10,.2f} MB" for kind, (n, size) in by_kind.items()]
    lines.append(_started_ahead_line(simulation, "window"))
    lines.append(
        f"  host syncs per window: {sum(syncs.values()):g} simulated; {projected:g} at the full model "
        f"({full_calls} MoE layer forwards x {per_call:g} + the rest: per forward the window's rows copied "
        "to the device and its losses read back, per window the dp replicas' pass counter)"
    )
    lines += [f"    {n:>6g}  {site}" for site, n in sorted(syncs.items(), key=lambda item: -item[1])]
    build = Counter(f"{s.kind} at {s.site}" for s in rank.syncs if s.phase == "build")
    lines.append(f"  building the model (split over the mesh, placed on the device): {sum(build.values())}")
    lines += [f"    {n:>6}  {site}" for site, n in build.items()]
    if dims.dp > 1:
        lines.append(
            "  after the last window: the results' all_gather_object over the dp group, once per evaluation "
            "(pickled numpy arrays: not simulated)"
        )
    return "\n".join(lines)


def simulate_eval_layout(
    config: TrainConfig, model_config: ModelConfig, gpu: str
) -> tuple[Simulation, ModelConfig]:
    """The planner's simulation of the evaluation on the run's own layout: the last rank of the mesh, one
    decoder layer of each kind at the real widths, a window of `trace_tokens` tokens per rank (as
    `simulate_layout`), and where the run scores the context cut, a bucket scaled down with the window so
    that the traced window has >= 2 of them and its cut splits over the cp ranks (the bucket divides the
    window, the cut is two buckets). Returns the simulation and the traced model config."""

    cp = config.parallel.cp
    unit = segments_per_rank(config.parallel.cp_layout) * 64 * model_config.index_kpool
    tokens = max(min(config.seq_len // cp, config.plan.trace_tokens) // unit * unit, unit)
    window = tokens * cp
    ContextLayout(window, cp, 0, config.parallel.cp_layout, kpool=model_config.index_kpool)
    cut = context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut) > 0
    bucket = window
    if cut:  # in halves of a split cut: a bucket of d halves dividing the window cuts 2d halves, whole units
        half = cp * unit // 2
        pieces = window // half
        target = max(window * config.eval.bucket // config.seq_len // half, 1)
        bucket = half * max(d for d in range(1, pieces // 2 + 1) if pieces % d == 0 and d <= target)
    traced = sub_config(model_config, reduced_layers(model_config))
    run = config.replace(seq=str(window), bucket=bucket, context_cut=cut)
    world = config.parallel.dp * cp
    return simulate_eval_step(run, traced, ranks=[world - 1], gpu=gpu), traced
