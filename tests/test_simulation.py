"""The multi-GPU step simulated on the CPU: fake CUDA tensors, collectives checked as NCCL would, host syncs
counted (`genomelm.parallel.simulation`, `genomelm.parallel.fake_cuda`, `genomelm.plan.simulate`)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from data_fixtures import fly_windows

from genomelm.model import ModelConfig
from genomelm.parallel.fake_cuda import run_on_fake_cuda
from genomelm.parallel.simulation import (
    Collective,
    CollectiveError,
    HostSync,
    SimulationMode,
    check_ranks_agree,
)
from genomelm.plan.simulate import (
    EXCHANGE_SYNC_SITE,
    RankSimulation,
    Simulation,
    describe_simulation,
    simulate_eval_layout,
    simulate_eval_step,
    simulate_step,
)
from genomelm.run.config import TrainConfig

CHUNKS = ["loss_chunk_tokens=64", "indexer_query_block=32", "attention_query_block=32"]


def _tiny(*settings: str) -> TrainConfig:
    return TrainConfig.from_args(["model=tiny", "fsdp=false", "precision=bf16", *CHUNKS, *settings])


def _check_sync_bound(config: TrainConfig, model: str) -> Simulation:
    """Every rank agrees on its collectives (checked inside), and a micro-batch's host syncs are the expert
    exchanges' split sizes only: one per MoE layer, for all its chunks. Returns the simulation."""
    model_config = ModelConfig.preset(model)
    simulation = simulate_step(config, model_config)
    assert len(simulation.ranks) == simulation.dims.world
    syncs = simulation.syncs_per_window()
    layers = simulation.expert_syncs_per_window(model_config)  # MoE layers, 0 without ep
    assert sum(syncs.values()) <= layers, syncs
    assert (sum(syncs.values()) > 0) == (layers > 0), syncs
    assert all(EXCHANGE_SYNC_SITE in site for site in syncs), syncs
    assert simulation.syncs_per_update() == {}
    assert not [s for r in simulation.ranks for s in r.syncs if s.phase == "input"]  # pinned, asynchronous
    kinds = Counter(c.kind for c in simulation.ranks[0].collectives)
    assert kinds["all_reduce"] and kinds["all_gather"] and kinds["reduce_scatter"]
    assert all(c.dtype for rank in simulation.ranks for c in rank.collectives)
    _assert_gpu_routes(simulation.ranks[0].routes)
    return simulation


@pytest.mark.slow
def test_dp2_cp2_ep2_step_on_fake_cuda_has_device_collectives_and_one_sync_per_moe_layer() -> None:
    """No CPU index tensor reaches a collective, and a micro-batch waits for the host once per MoE layer:
    the split sizes of its 4 chunks (128 tokens each of a rank's 512), read at once. The expert exchanges
    are started without waiting where `ep_overlap` starts them ahead: of each chunk's six (a dispatch and a
    combine in the forward, the recompute and the backward), all but the backward's dispatch."""
    config = _tiny("seq=1024", "dp=2", "cp=2", "ep=2", "moe_chunk_tokens=128")
    simulation = _check_sync_bound(config, "tiny")
    for rank in range(simulation.dims.world):
        ahead, total = simulation.started_ahead(rank)["all_to_all"]
        assert total == 3 * 4 * 6 and ahead == 3 * 4 * 5  # tiny's 3 MoE layers x 4 chunks
        assert all(not c.started_ahead for c in simulation.ranks[rank].collectives if c.kind != "all_to_all")


def test_experts_placed_with_copies_on_fake_cuda_exchange_the_copies_weights_once_per_layer_pass() -> None:
    """dp2 x ep2 with the experts placed by (a skewed) load and a copy slot per rank (`simulated_placements`):
    the same syncs as the static blocks (one per MoE layer), and one more all-to-all per MoE layer and pass
    (forward, recompute, backward) for the copies' weights and gradients, in fp32 like the weights here."""
    config = _tiny("seq=512", "dp=2", "ep=2", "moe_chunk_tokens=128", "expert_placement=balanced")
    model_config = ModelConfig.preset("tiny")
    runs = [config.replace(expert_copies=1), config.replace(expert_placement="static")]
    simulation, static = run_on_fake_cuda(_simulate_each, runs, model_config)  # one process for both
    for ranks in (simulation.ranks, static.ranks):
        check_ranks_agree([r.collectives for r in ranks])
    syncs = simulation.syncs_per_window()
    assert sum(syncs.values()) == simulation.expert_syncs_per_window(model_config) == 3, syncs
    assert all(EXCHANGE_SYNC_SITE in site for site in syncs), syncs
    for placed, plain in zip(simulation.ranks, static.ranks):
        exchanges = [c for c in placed.collectives if c.kind == "all_to_all"]
        assert len(exchanges) == len([c for c in plain.collectives if c.kind == "all_to_all"]) + 3 * 3
        assert {c.dtype for c in exchanges} == {"bfloat16", "float32"}


def _simulate_each(configs: list[TrainConfig], model_config: ModelConfig) -> list[Simulation]:
    """In the fake-CUDA process: every rank's step of each config (`simulate_step`'s, in one process)."""
    from genomelm.plan.simulate import _simulate_ranks

    return [
        _simulate_ranks(c, model_config, list(range(c.parallel.dp * c.parallel.cp)), "h200") for c in configs
    ]


@pytest.mark.slow
def test_cp4_step_of_small_on_fake_cuda() -> None:
    config = TrainConfig.from_args(
        ["model=small", "seq=2048", "cp=4", "fsdp=false", "precision=bf16", "moe_chunk_tokens=256", *CHUNKS]
    )
    _check_sync_bound(config, "small")


def test_a_cpu_tensor_in_a_collective_is_caught_with_its_line() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mode = SimulationMode("cuda")
        with FakeTensorMode(), mode:
            dist.all_reduce(torch.ones(4, device="cuda"))
            with pytest.raises(
                CollectiveError, match=r"all_reduce over ranks \[0, 1\] at tests/test_simulation"
            ):
                dist.all_reduce(torch.ones(4))  # a host tensor: NCCL rejects it
            with pytest.raises(CollectiveError, match="not contiguous"):
                dist.all_reduce(torch.ones(4, 4, device="cuda").T)
        assert [(c.kind, c.ranks, c.bytes) for c in mode.collectives] == [("all_reduce", (0, 1), 16)]
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_are_named() -> None:
    def issued(kind: str, shape: tuple[int, ...]) -> Collective:
        return Collective(kind, (0, 1), "float32", 4, (shape,), "here", "window")

    check_ranks_agree([[issued("all_reduce", (4,))], [issued("all_reduce", (4,))]])
    with pytest.raises(CollectiveError, match="rank 0 issues 2 collectives, rank 1 1"):
        check_ranks_agree([[issued("all_reduce", (4,))] * 2, [issued("all_reduce", (4,))]])
    with pytest.raises(CollectiveError, match="rank 1 all_reduce float32"):
        check_ranks_agree([[issued("all_reduce", (4,))], [issued("all_reduce", (8,))]])


def _mesh_collectives_off_the_step() -> list[str]:
    """In a fake-CUDA process: the metric and clipping collectives of a dp 2 x ep 2 mesh (a rank without
    gradients included) go through the checking mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from genomelm.model import GlmForCausalLM
    from genomelm.parallel.mesh import ParallelDims
    from genomelm.parallel.training import ParallelRun
    from genomelm.plan.simulate import simulated_gpu

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        with simulated_gpu("h200"):
            parallel = ParallelRun.from_environment(ParallelDims(2, 1, 2), "zigzag", False, "cuda")
            mode = SimulationMode("cuda")
            with FakeTensorMode(), mode:
                model = GlmForCausalLM.from_config(ModelConfig.preset("tiny"), device="cuda")
                parallel.prepare(model, None, 8.0)
                parallel.mean_over_data(torch.ones(2, device="cuda"))
                parallel.expert_rows_by_rank(model)
                parallel.clip_grad_norm_(model, 1.0)  # no gradients on this rank
        return [f"{c.kind} {c.dtype} {len(c.ranks)}" for c in mode.collectives]
    finally:
        dist.destroy_process_group()


def test_metric_and_clipping_collectives_take_device_tensors() -> None:
    """Before the fix each of these handed NCCL a host tensor (a crash at the end of the first GPU step):
    `mean_over_data` (a float made into a CPU tensor), `expert_rows_by_rank`, and the clipping of a rank
    without gradients."""
    issued = run_on_fake_cuda(_mesh_collectives_off_the_step, timeout_s=300)
    assert issued == ["all_reduce float32 2", "all_gather float64 2", "all_reduce float64 2"]


def _gloo_step_collectives(config: TrainConfig) -> list[tuple[str, tuple[int, ...], str, int]]:
    """This rank's collectives in one optimizer step of the training loop's own run (gloo, real tensors)."""
    from genomelm.train.loop import build_run, step_windows

    torch.set_num_threads(1)
    run = build_run(config)
    mode = SimulationMode("cpu")
    with mode:
        outcome = run.step.run(1e-3, step_windows(run, 0, []))
    assert outcome.finite
    return [(c.kind, c.ranks, c.dtype, c.bytes if c.kind != "all_to_all" else 0) for c in mode.collectives]


@pytest.mark.slow
def test_simulated_collectives_equal_a_real_two_rank_gloo_step(tmp_path: Path) -> None:
    """Kind, group, dtype and bytes of every collective, in order, as the trainer's step on two gloo
    processes dispatches them (the all-to-all's bytes follow the real routing, so only their count is
    compared)."""
    from genomelm.parallel.launch import launch

    data = fly_windows(tmp_path / "fly", "1-4096", 1024)
    settings = [f"data={data}", "seq=1024", "cp=2", "ep=2", "moe_chunk_tokens=128", "offload=false"]
    settings += [f"runs_dir={tmp_path / 'runs'}", "wandb=disabled", "grad_accum=1"]
    config = _tiny(*settings)
    real = launch(_gloo_step_collectives, 2, config, timeout_s=600)
    simulation = simulate_step(config, ModelConfig.preset("tiny"))
    for rank, issued in enumerate(real):
        simulated = simulation.ranks[rank].collectives
        assert issued == [
            (c.kind, c.ranks, c.dtype, c.bytes if c.kind != "all_to_all" else 0) for c in simulated
        ]


def _assert_gpu_routes(routes: str) -> None:
    """The simulated step took the GPU's kernels in every block (no silent torch path): fla's KDA (its
    context-parallel summaries too), the Triton indexer, sparse attention and mHC."""
    assert "kda: fla chunk_kda (cuda, bf16 q/k/v" in routes and "cp summaries on fla chunk_kda" in routes
    assert "indexer: triton fused scores" in routes and "dsa: triton sparse MLA" in routes
    assert "mhc: triton fused (bf16 streams)" in routes and "mhc: torch" not in routes
    assert "sparse gather" not in routes and "indexer: torch" not in routes, routes


def _tracked_peak(device_type: str) -> int:
    """Peak bytes MemTracker sees in one forward + backward of `tiny` (2,048 tokens, recompute, bf16
    autocast, torch KDA, the Triton kernels' fakes elsewhere) on fake tensors of `device_type`, in a fake-CUDA
    process."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from genomelm.model import GlmForCausalLM
    from genomelm.model.backends import as_on_gpu, tracing_kernels
    from genomelm.model.config import RunOptions
    from genomelm.plan.simulate import simulated_gpu
    from genomelm.train.memory import LayerRunner

    options = as_on_gpu(RunOptions(kda_backend="torch", moe_chunk_tokens=512))[0]  # as the planner traces
    with simulated_gpu("h200"), tracing_kernels(), FakeTensorMode(), SimulationMode(device_type):
        device = torch.device(device_type)
        model = GlmForCausalLM.from_config(ModelConfig.preset("tiny"), options, device=device)
        ids = torch.zeros(1, 2048, dtype=torch.long, device=device)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                nll = model(
                    ids, ids, reduction="none", layer_runner=LayerRunner(recompute=True, offload=False)
                )
            nll.sum().backward()
        return sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def _tracked_peaks() -> tuple[int, int]:
    """`_tracked_peak` on fake CUDA tensors and on fake CPU ones, in one fake-CUDA process."""
    return _tracked_peak("cuda"), _tracked_peak("cpu")


@pytest.mark.slow
def test_the_planners_cpu_trace_holds_what_the_cuda_step_holds() -> None:
    """The planner measures memory on fake CPU tensors; the same step on fake CUDA tensors (CUDA's autocast
    op lists, the CUDA branches) peaks within 0.5% of it (measured: +0.15% for this step)."""
    cuda, cpu = run_on_fake_cuda(_tracked_peaks, timeout_s=600)
    assert cpu > 0 and abs(cuda - cpu) <= 0.005 * cpu, (cuda, cpu)


def _tiny_eval(*settings: str) -> TrainConfig:
    """`tiny` evaluated as on GPUs: FSDP2 (the default), bf16, a context cut of 256-token buckets."""
    return TrainConfig.from_args(["model=tiny", "precision=bf16", "bucket=256", *CHUNKS, *settings])


@pytest.fixture(scope="module")
def tiny_eval() -> tuple[TrainConfig, Simulation]:
    """Every rank of dp 2 x cp 2 x ep 2 scoring one 1,024-token window of `tiny` (its forward and the
    context cut's 512 tokens), on fake CUDA; the ranks' collectives pair up (checked inside)."""
    config = _tiny_eval("seq=1024", "dp=2", "cp=2", "ep=2", "moe_chunk_tokens=128")
    return config, simulate_eval_step(config, ModelConfig.preset("tiny"))


# where the scoring of a window may wait for the device: the expert exchange's split sizes, the window's
# rows to the device and its losses read back (`token_losses`), the dp replicas' pass counter (`_sum`)
EVAL_SYNC_SITES = (EXCHANGE_SYNC_SITE, "in token_losses", "in _sum")


def test_dp2_cp2_ep2_eval_step_is_forward_only_with_syncs_at_the_exchange_and_the_read_back(
    tiny_eval: tuple[TrainConfig, Simulation],
) -> None:
    """The evaluator's own path (`ScoringRun`, `build_scoring_model` with FSDP2, `ContextParallelScorer`,
    `score_windows`) on every rank: no collective NCCL would reject (each raises), no backward collective
    (no reduce-scatter), and a window's host syncs only where stated, bounded."""
    config, simulation = tiny_eval
    model_config = ModelConfig.preset("tiny")
    assert len(simulation.ranks) == simulation.dims.world == 4
    assert simulation.stage == "eval" and simulation.cut_tokens == 512  # the last bucket + the one before
    forwards = 2
    for rank in simulation.ranks:
        kinds = Counter(c.kind for c in rank.collectives)
        assert set(kinds) == {"all_gather", "all_to_all", "all_reduce"}, kinds  # no reduce-scatter
        assert {c.phase for c in rank.collectives} == {"window"}
        reduces = [c for c in rank.collectives if c.kind == "all_reduce"]
        dp_group = tuple(r for r in range(4) if r % 2 == rank.rank % 2)
        issued = [(c.dtype, c.ranks, c.site.split(" in ")[-1]) for c in reduces]
        assert issued == [("int64", dp_group, "_sum")]  # the pass counter only
        _assert_gpu_routes(rank.routes)
    syncs = simulation.syncs_per_window()
    exchanges = simulation.expert_syncs_per_window(model_config)
    assert exchanges == 3 * 2  # MoE layers x both forwards (each reads all its chunks' sizes at once)
    by_site = {key: sum(n for site, n in syncs.items() if key in site) for key in EVAL_SYNC_SITES}
    assert sum(by_site.values()) == sum(syncs.values()), syncs  # nowhere else
    # one per MoE layer and forward
    assert 0 < by_site[EXCHANGE_SYNC_SITE] <= exchanges, syncs
    # per forward: the read-back, and (from pageable host memory) the ids' and the labels' copies
    assert forwards <= by_site["in token_losses"] <= 3 * forwards, syncs
    assert by_site["in _sum"] <= 2, syncs  # its count to the device and the sum read back


def _fsdp_gathers(model_config: ModelConfig, world: int) -> Counter[tuple[str, int]]:
    """(dtype, elements) of each FSDP2 all-gather over all ranks in one evaluated window of two forwards, and
    the count of each: per decoder layer and forward its bf16-stored replicated parameters in bf16 and its
    fp32-declared ones in fp32; the root (embedding, norm, head) in the first forward only (FSDP2 keeps the
    root unsharded after its forward). FSDP2 pads each parameter's dim 0 to a multiple of the group's size."""
    from genomelm.model import GlmForCausalLM

    model = GlmForCausalLM.from_config(model_config, None, torch.bfloat16, "meta")
    units: dict[str, Counter[str]] = {}
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:  # gathered over the ranks holding the same experts instead
            continue
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        padded = -(-param.shape[0] // world) * world * math.prod(param.shape[1:])
        units.setdefault(unit, Counter())[str(param.dtype).removeprefix("torch.")] += padded
    out: Counter[tuple[str, int]] = Counter()
    for unit, sizes in units.items():
        for dtype, numel in sizes.items():
            out[dtype, numel] += 1 if unit == "root" else 2
    return out


def test_eval_step_stores_and_gathers_bf16_parameters_and_the_fp32_declared_in_fp32(
    tiny_eval: tuple[TrainConfig, Simulation],
) -> None:
    """precision=bf16: every rank stores its shard in bf16 (the fp32-declared parameters in fp32), never an
    fp32 copy, and FSDP2 gathers each layer's parameters in those dtypes, whole: the bytes stored over the
    ranks are the bf16 build's, and the gathers over all ranks are exactly the units' padded parameters."""
    from genomelm.model import GlmForCausalLM

    _, simulation = tiny_eval
    model_config = ModelConfig.preset("tiny")
    built = GlmForCausalLM.from_config(model_config, None, torch.bfloat16, "meta")
    expected: Counter[str] = Counter()
    for param in built.parameters():
        expected[str(param.dtype).removeprefix("torch.")] += param.numel() * param.element_size()
    stored = sum((Counter(r.parameter_bytes) for r in simulation.ranks), Counter())
    assert stored == expected and set(expected) == {"bfloat16", "float32"}, stored
    rank = simulation.ranks[0]
    itemsize = {"bfloat16": 2, "float32": 4}
    everyone = Counter(
        (c.dtype, c.bytes // itemsize[c.dtype])
        for c in rank.collectives
        if c.kind == "all_gather" and c.ranks == (0, 1, 2, 3)
    )
    assert everyone == _fsdp_gathers(model_config, world=4)
    # this ep rank's half of the experts, over the ranks holding the same ones (rank 0's: ranks 0 and 2)
    experts = sum(p.numel() for n, p in built.named_parameters() if ".mlp.experts." in n) // 2
    same_experts = [c for c in rank.collectives if c.kind == "all_gather" and c.ranks == (0, 2)]
    assert {c.dtype for c in same_experts} == {"bfloat16"}
    assert sum(c.bytes for c in same_experts) == 2 * experts * 2  # two forwards, bf16


def test_eval_layout_of_a_planned_run_is_the_evaluations_forward_with_its_context_cut() -> None:
    """`genomelm plan stage=eval`'s simulation: the last rank at the traced tokens, a context cut that splits
    over the cp ranks, described as the evaluator's forward with the host syncs projected to the whole
    window (its expert exchanges at the run's own tokens)."""
    config = _tiny_eval("seq=4096", "bucket=1024", "dp=2", "cp=2", "ep=2", "moe_chunk_tokens=128")
    config = config.replace(trace_tokens=512)
    model_config = ModelConfig.preset("tiny")
    simulation, traced = simulate_eval_layout(config, model_config, "h200")
    assert [r.rank for r in simulation.ranks] == [3]
    assert simulation.stage == "eval" and simulation.tokens_per_window == 1024 and simulation.cut_tokens > 0
    text = describe_simulation(simulation, config, traced, model_config)
    ahead, total = simulation.started_ahead(0, "window")["all_to_all"]
    assert total and ahead == total  # the forward's dispatches and combines, every one started ahead
    assert f"all_to_all {ahead} of {total}" in text
    syncs = simulation.syncs_per_window()
    exchange = sum(n for site, n in syncs.items() if EXCHANGE_SYNC_SITE in site)
    calls = simulation.expert_syncs_per_window(traced)
    assert 0 < exchange <= calls
    full = 3 * 2  # MoE layers x the run's own forwards (the window's, then the cut's)
    simulated = sum(syncs.values())
    projected = simulated - exchange + exchange / calls * full
    assert f"host syncs per window: {simulated:g} simulated; {projected:g} at the full model" in text
    assert text.startswith("simulated evaluation forward on fake CUDA (rank 3 of dp 2 x cp 2, ep 2;")
    assert "then the context cut's 512" in text and "reduce_scatter" not in text
    assert "the results' all_gather_object over the dp group" in text


def _rank_0_scoring_each(configs: list[TrainConfig], model_config: ModelConfig) -> list[Simulation]:
    """In the fake-CUDA process: rank 0 of each config scoring a window (`simulate_eval_step`'s, in one
    process)."""
    from genomelm.plan.simulate import _simulate_eval_ranks

    return [_simulate_eval_ranks(config, model_config, [0], "h200") for config in configs]


def _first_forward(
    simulation: Simulation, model_config: ModelConfig
) -> tuple[list[Collective], list[HostSync], RankSimulation]:
    """Rank 0 of an evaluated window on fake CUDA under FSDP2 (`_rank_0_scoring_each`): the all-gathers of
    the whole model's bf16 parameter groups in its first forward (the root's, then one per decoder layer, in
    layer order), and that forward's host syncs at the expert exchanges (one per MoE layer, in layer
    order)."""
    rank = simulation.ranks[0]
    world = tuple(range(simulation.dims.world))
    gathers = [
        c
        for c in rank.collectives
        if c.kind == "all_gather" and c.dtype == "bfloat16" and c.ranks == world and c.phase == "window"
    ]
    syncs = [s for s in rank.syncs if EXCHANGE_SYNC_SITE in s.site and s.phase == "window"]
    moe_layers = sum(kind == "sparse" for kind in model_config.mlp_layer_types)
    return gathers[: model_config.num_hidden_layers + 1], syncs[:moe_layers], rank


def test_fsdp_prefetch_issues_the_next_layers_gather_before_this_layers_host_sync() -> None:
    """fsdp_prefetch=1 (dp 2 x ep 2, FSDP2, bf16): in the forward, every MoE layer after the first issues the
    next layer's all-gather before its own host sync (the expert exchange's split sizes), so the gather runs
    on its stream while the host waits; without prefetch the host reaches that gather only after the sync.
    The collectives (kind, group, dtype, bytes) and the host syncs are the same, only issued earlier."""
    model_config = ModelConfig.preset("tiny")
    settings = ["seq=512", "dp=2", "ep=2", "moe_chunk_tokens=128"]
    layer_kinds = model_config.mlp_layer_types
    moe = [index for index, kind in enumerate(layer_kinds) if kind == "sparse"]
    checked = [(k, layer) for k, layer in enumerate(moe) if layer >= 1 and layer + 1 < len(layer_kinds)]
    assert len(checked) == 2  # tiny: MoE layers 1 and 2 have a next layer (3 is the last)
    configs = [_tiny_eval(*settings, f"fsdp_prefetch={prefetch}") for prefetch in (0, 1)]
    simulations = run_on_fake_cuda(_rank_0_scoring_each, configs, model_config)
    runs = {}
    for prefetch in (0, 1):
        gathers, syncs, rank = _first_forward(simulations[prefetch], model_config)
        assert len(gathers) == model_config.num_hidden_layers + 1 and len(syncs) == len(moe)
        # gathers[layer + 1] is the layer's (gathers[0]: the root's); the next layer's is gathers[layer + 2]
        ahead = [gathers[layer + 2].issued < syncs[k].issued for k, layer in checked]
        assert ahead == [bool(prefetch)] * len(checked), (prefetch, gathers, syncs)
        runs[prefetch] = rank
    issued = [
        Counter((c.kind, c.ranks, c.dtype, c.bytes) for c in runs[p].collectives if c.kind != "all_to_all")
        for p in (0, 1)
    ]
    assert issued[0] == issued[1]
    assert Counter(s.site for s in runs[0].syncs) == Counter(s.site for s in runs[1].syncs)


def _torchao_fp8_kernel_shapes(calls: Counter[str]) -> None:
    """torchao's Triton FP8 quantisers as its own fake implementations give them (outputs of the kernels'
    shapes, dtypes and layouts), each call counted in `calls`: on a machine without a GPU torchao does not
    build the kernels, so it has no custom ops to fake. What is simulated is the rest of the path: the groups'
    padding, torchao's autograd function and `torch._scaled_grouped_mm` on fake CUDA."""
    import torchao.prototype.moe_training.fp8_grouped_mm as fp8

    def rowwise_2d(t: torch.Tensor, output_dtype: torch.dtype, **_: object) -> tuple[torch.Tensor, ...]:
        calls["rowwise_2d"] += 1
        return torch.empty(t.shape, dtype=output_dtype, device=t.device), t.new_empty(t.shape[0], 1).float()

    def colwise_3d(t: torch.Tensor, output_dtype: torch.dtype, **_: object) -> tuple[torch.Tensor, ...]:
        calls["colwise_3d"] += 1
        e, k, n = t.shape
        data = torch.empty((e, k, n), dtype=output_dtype, device=t.device).as_strided(
            (e, k, n), (k * n, 1, k)
        )
        return data, torch.empty((e, 1, n), dtype=torch.float32, device=t.device)

    def transpose_rhs(t: torch.Tensor, output_dtype: torch.dtype, **_: object) -> tuple[torch.Tensor, ...]:
        calls["transpose_rhs"] += 1
        e, k, n = t.shape
        data = torch.empty((e, n, k), dtype=output_dtype, device=t.device).as_strided(
            (e, n, k), (n * k, 1, n)
        )
        return data, torch.empty((e, k), dtype=torch.float32, device=t.device)

    def colwise_dual(
        a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, output_dtype: torch.dtype, **_: object
    ) -> tuple[torch.Tensor, ...]:
        calls["colwise_dual"] += 1
        m, groups = a.shape[0], offsets.numel()
        out = []
        for t in (a, b):
            data = torch.empty(t.shape, dtype=output_dtype, device=t.device).as_strided(t.shape, (1, m))
            out += [data, torch.empty(t.shape[1] * groups, dtype=torch.float32, device=t.device)]
        return tuple(out)

    fp8.triton_fp8_rowwise_2d_scale_and_cast = rowwise_2d
    fp8.triton_fp8_colwise_3d_scale_and_cast = colwise_3d
    fp8.triton_fp8_rowwise_3d_transpose_rhs = transpose_rhs
    fp8.triton_fp8_per_group_colwise_scales_dual = colwise_dual


def _fp8_expert_step(config: TrainConfig, model_config: ModelConfig) -> tuple[Simulation, Counter[str]]:
    """In the fake-CUDA process: every rank's step with torchao's FP8 quantisers as their shapes; the
    simulation and the quantisers' calls."""
    from genomelm.plan.simulate import _simulate_ranks

    calls: Counter[str] = Counter()
    _torchao_fp8_kernel_shapes(calls)
    world = config.parallel.dp * config.parallel.cp
    return _simulate_ranks(config, model_config, list(range(world)), "h200"), calls


def test_fp8_expert_gemms_on_fake_cuda_add_no_host_sync_and_no_host_tensor() -> None:
    """expert_precision=fp8_rowwise at dp 2 x ep 2 on fake CUDA (H200): torchao's FP8 grouped GEMM on every
    rank in every MoE layer's forward, recompute and backward, every tensor of it on the device (a host tensor
    in a collective raises; the padding of the groups is computed on the device), and the host syncs of the
    bf16 experts only: one per MoE layer and micro-batch, at the exchange's split sizes."""
    model_config = ModelConfig.preset("tiny")
    config = _tiny("seq=512", "dp=2", "ep=2", "moe_chunk_tokens=128", "expert_precision=fp8_rowwise")
    simulation, calls = run_on_fake_cuda(_fp8_expert_step, config, model_config)
    check_ranks_agree([r.collectives for r in simulation.ranks])
    assert "fp8_rowwise expert GEMMs" in simulation.ranks[0].routes
    # each pass: 2 ranks x 3 MoE layers x 4 chunks (512 tokens each) x 2 GEMMs; the forward quantises the rows
    # and the weights, in the forward and in the recompute; the backward the output gradient twice (by rows;
    # by each group's columns, with the rows) and the weights once
    gemms = 2 * 3 * 4 * 2
    assert calls == {
        "rowwise_2d": 3 * gemms,
        "colwise_3d": 2 * gemms,
        "transpose_rhs": gemms,
        "colwise_dual": gemms,
    }
    syncs = simulation.syncs_per_window()
    assert sum(syncs.values()) == simulation.expert_syncs_per_window(model_config) == 3, syncs
    assert all(EXCHANGE_SYNC_SITE in site for site in syncs), syncs
    assert simulation.syncs_per_update() == {}
