"""The multi-GPU step simulated on the CPU: fake CUDA tensors, collectives checked as NCCL would, host syncs
counted (`genomelm.parallel.simulation`, `genomelm.parallel.fake_cuda`, `genomelm.train.simulate`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from data_fixtures import fly_windows

from genomelm.model import ModelConfig
from genomelm.parallel.fake_cuda import run_on_fake_cuda
from genomelm.parallel.simulation import Collective, CollectiveError, SimulationMode, check_ranks_agree
from genomelm.train.config import TrainConfig
from genomelm.train.simulate import simulate_step

CHUNKS = ["loss_chunk_tokens=64", "indexer_query_block=32", "attention_query_block=32"]


def _tiny(*settings: str) -> TrainConfig:
    return TrainConfig.from_args(["model=tiny", "fsdp=false", "precision=bf16", *CHUNKS, *settings])


def _check_sync_bound(config: TrainConfig, model: str) -> None:
    """Every rank agrees on its collectives (checked inside), and a micro-batch's host syncs are the expert
    exchanges' split sizes only: one per exchange."""
    model_config = ModelConfig.preset(model)
    simulation = simulate_step(config, model_config)
    assert len(simulation.ranks) == simulation.dims.world
    syncs = simulation.syncs_per_window()
    exchanges = simulation.moe_calls_per_window(config, model_config)
    assert sum(syncs.values()) <= exchanges, syncs
    assert all("expert_parallel_forward" in site for site in syncs), syncs
    assert simulation.syncs_per_update() == {}
    assert not [s for r in simulation.ranks for s in r.syncs if s.phase == "input"]  # pinned, asynchronous
    kinds = Counter(c.kind for c in simulation.ranks[0].collectives)
    assert kinds["all_reduce"] and kinds["all_gather"] and kinds["reduce_scatter"]
    assert all(c.dtype for rank in simulation.ranks for c in rank.collectives)
    assert "kda: fla chunk_kda (cuda) + context parallel" in simulation.ranks[0].routes  # the GPU's route


@pytest.mark.slow
def test_dp2_cp2_ep2_step_on_fake_cuda_has_device_collectives_and_one_sync_per_exchange() -> None:
    """Before the fixes: CPU index tensors copied per exchange (`torch.tensor(..., device=...)` in the
    backward), `.tolist()` / `int()` / `repeat_interleave` syncs, several per exchange."""
    config = _tiny("seq=1024", "dp=2", "cp=2", "ep=2", "moe_chunk_tokens=128")
    _check_sync_bound(config, "tiny")


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
    from genomelm.train.simulate import simulated_gpu

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


def _tracked_peak(device_type: str) -> int:
    """Peak bytes MemTracker sees in one forward + backward of `small` (2,048 tokens, recompute, bf16
    autocast, torch KDA) on fake tensors of `device_type`, in a fake-CUDA process."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from genomelm.model import GlmForCausalLM
    from genomelm.model.config import RunOptions
    from genomelm.train.memory import LayerRunner
    from genomelm.train.simulate import simulated_gpu

    options = RunOptions(kda_backend="torch", moe_chunk_tokens=512)
    with simulated_gpu("h200"), FakeTensorMode(), SimulationMode(device_type):
        device = torch.device(device_type)
        model = GlmForCausalLM.from_config(ModelConfig.preset("small"), options, device=device)
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


@pytest.mark.slow
def test_the_planners_cpu_trace_holds_what_the_cuda_step_holds() -> None:
    """The planner measures memory on fake CPU tensors; the same step on fake CUDA tensors (CUDA's autocast
    op lists, the CUDA branches) peaks within 0.5% of it (measured: +0.03% for this step)."""
    cuda, cpu = (run_on_fake_cuda(_tracked_peak, kind, timeout_s=300) for kind in ("cuda", "cpu"))
    assert cpu > 0 and abs(cuda - cpu) <= 0.005 * cpu, (cuda, cpu)
