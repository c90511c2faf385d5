"""The multi-GPU training step, simulated on this CPU: every rank's `TrainStep.run` on fake CUDA tensors, its
collectives checked against NCCL's rules and compared across ranks, its host syncs counted.

`simulate_step(config)` runs, in one fake-CUDA process (`genomelm.parallel.fake_cuda`), each rank of the
run's dp x cp mesh in turn (ep borrowing its ranks) on torch's fake process group: the model built on
`cuda`, split by the trainer's own `ParallelRun.prepare` (context and expert parallelism), the trainer's
`LayerRunner` and optimizer, one optimizer step of `grad_accum` windows per dp rank through the trainer's own
`TrainStep.run`, all inside `genomelm.parallel.simulation.SimulationMode`. The CUDA branches of the code run
(`device.type == "cuda"`, bf16 autocast on cuda, the grouped GEMM at the GPU's compute capability), so a CPU
tensor handed to a collective, a collective one rank skips, or a host sync in the hot path shows here as it
would on the first GPU step.

What the simulation cannot see, and what stands in for it:
- values: fake tensors hold none; the routing is balanced (every expert receives its share), a loss or norm
  read returns a placeholder, the step is taken as finite;
- kernels: fla's and any Triton kernel cannot run on fake tensors. fla's `chunk_kda` enters as a custom op
  with a fake implementation (`fla_stand_in`: output and final state of the right shapes and dtypes, fla's
  saved inputs, gradients of the inputs' shapes), so KDA takes the route it takes on a GPU (`auto` -> fla,
  the context-parallel summary without queries) whether or not fla is installed here;
- FSDP2: sharding allocates its buffers on the device as real tensors (and it creates CUDA streams), which
  the stand-ins cannot give, so the simulated mesh runs without FSDP (`fsdp=false`: the replicated
  gradients' all-reduce stands in for its reduce-scatters), and FSDP2's collectives are counted on gloo
  instead (tests/test_parallel_fsdp.py);
- NCCL's timing, real overlap, kernel-internal behaviour and memory fragmentation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.model.config import MOE
from genomelm.parallel.fake_cuda import run_on_fake_cuda
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.simulation import Collective, HostSync, SimulationMode, check_ranks_agree
from genomelm.parallel.training import ParallelRun
from genomelm.train.config import TrainConfig
from genomelm.train.memory import LayerRunner, set_chunk_recompute
from genomelm.train.step import StepPhases, TrainStep, device_rows, make_optimizer

GPU_CAPABILITY = {"b200": (10, 0), "h200": (9, 0), "h100": (9, 0)}


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


@dataclass
class Simulation:
    """Every simulated rank of one optimizer step."""

    dims: ParallelDims
    tokens_per_window: int
    ranks: list[RankSimulation] = field(default_factory=list)

    def moe_calls_per_window(self, config: TrainConfig, model_config: ModelConfig) -> int:
        """Expert exchanges per micro-batch that need their split sizes on the host: MoE layers x chunks of
        the rank's tokens (a recompute reuses the forward's)."""
        layers = sum(kind == MOE for kind in model_config.mlp_layer_types)
        tokens = self.tokens_per_window // self.dims.cp
        chunks = -(-tokens // config.model_options.moe_chunk_tokens)
        return layers * chunks if self.dims.ep > 1 else 0

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

    def collectives_by_kind(self, rank: int = 0) -> dict[str, tuple[int, int]]:
        """(count, bytes) per "kind over group-size ranks" of one rank's step."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.ranks[rank].collectives:
            key = f"{c.kind} ({c.dtype}) over {len(c.ranks)} ranks"
            count, size = out.get(key, (0, 0))
            out[key] = (count + 1, size + c.bytes)
        return out


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


@torch.library.custom_op("genomelm_simulation::chunk_kda", mutates_args=())
def _chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_kda` in the simulation: q, k, g [B, S, H, Dk], v [B, S, H, Dv], beta [B, S, H], state
    [B, H, Dk, Dv] fp32 -> (out like v, final state fp32). Fake tensors only."""
    raise RuntimeError("the chunk_kda stand-in runs on fake tensors only (the simulation)")


@_chunk_kda.register_fake
def _(q, k, v, g, beta, state):
    return torch.empty_like(v), torch.empty_like(state, dtype=torch.float32)


def _chunk_kda_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # fla keeps its inputs for the backward (and recomputes the rest)


def _chunk_kda_backward(ctx, grad_out, grad_state):
    return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


_chunk_kda.register_autograd(_chunk_kda_backward, setup_context=_chunk_kda_setup)


def _chunk_kda_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stand-in with `fla.ops.kda.chunk_kda`'s keyword arguments (as `kda_core` calls it)."""
    if initial_state is None:
        batch, _, heads, dk = k.shape
        initial_state = k.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32)
    return _chunk_kda(q, k, v, g, beta, initial_state)


@contextmanager
def fla_stand_in() -> Iterator[None]:
    """`fla_chunk_kda()` returns the stand-in (as if fla were installed) while inside."""
    from genomelm.model import kda, kda_chunk

    saved = kda.fla_chunk_kda, kda_chunk.fla_chunk_kda
    kda.fla_chunk_kda = kda_chunk.fla_chunk_kda = lambda: _chunk_kda_call
    try:
        yield
    finally:
        kda.fla_chunk_kda, kda_chunk.fla_chunk_kda = saved


def _simulate_ranks(config: TrainConfig, model_config: ModelConfig, ranks: list[int], gpu: str) -> Simulation:
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    simulation = Simulation(dims, config.seq_len)
    with simulated_gpu(gpu), fla_stand_in():
        for rank in ranks:
            simulation.ranks.append(_simulate_rank(config, model_config, dims, rank))
    return simulation


def _simulate_rank(
    config: TrainConfig, model_config: ModelConfig, dims: ParallelDims, rank: int
) -> RankSimulation:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from genomelm.train.precision import fsdp_param_dtype

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
                parallel.prepare(model, param_dtype, config.parallel.ep_capacity_factor)
            model.train()
            runner = LayerRunner.for_memory(config.memory, offload=False)
            optimizer = make_optimizer(model, config.optim, device)
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


def describe_simulation(
    simulation: Simulation, config: TrainConfig, traced: ModelConfig, full: ModelConfig
) -> str:
    """The simulated step as the planner prints it: collectives per step by kind and group, host syncs per
    micro-batch by site, as simulated (the `traced` layers) and at the whole model's size."""
    rank = simulation.ranks[-1]
    syncs = simulation.syncs_per_window()
    traced_calls = simulation.moe_calls_per_window(config, traced)
    full_sim = Simulation(simulation.dims, config.seq_len)
    full_calls = full_sim.moe_calls_per_window(config, full)
    exchange = sum(n for site, n in syncs.items() if "expert_parallel_forward" in site)
    per_call = exchange / traced_calls if traced_calls else 0.0
    projected = sum(syncs.values()) - exchange + per_call * full_calls
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
    lines.append(
        f"  host syncs per micro-batch: {sum(syncs.values()):g} simulated; {projected:g} at the full model "
        f"({full_calls} expert exchanges x {per_call:g} + the rest: the exchange's split sizes, inherent; a "
        "recompute reuses the forward's)"
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
    rank's own, if fewer; rounded to whole KDA chunks and k-pools of every segment). Returns the simulation
    and the traced model config."""
    from genomelm.parallel.layout import ContextLayout, segments_per_rank
    from genomelm.train.plan_trace import reduced_layers, sub_config

    cp = config.parallel.cp
    unit = segments_per_rank(config.parallel.cp_layout) * 64 * model_config.index_kpool
    tokens = max(min(config.seq_len // cp, config.plan.trace_tokens) // unit * unit, unit)
    ContextLayout(tokens * cp, cp, 0, config.parallel.cp_layout, kpool=model_config.index_kpool)
    traced = sub_config(model_config, reduced_layers(model_config))
    world = config.parallel.dp * cp
    run = config.replace(seq=str(tokens * cp), grad_accum=1)
    return simulate_step(run, traced, ranks=[world - 1], gpu=gpu), traced
