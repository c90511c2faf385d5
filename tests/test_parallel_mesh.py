"""The dp x cp (x ep) mesh: layouts refused before launch, data parallel and FSDP2 equal to one process,
sharded checkpoints resumed at other world sizes (gloo, 2 and 4 local processes, tiny model, real fly DNA)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows

from genomelm.parallel.mesh import ParallelDims
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_layouts_refused_with_the_reason() -> None:
    from genomelm.run.launchers import check_layout

    assert ParallelDims(2, 4, 8).coordinates(5) == {"dp": 1, "cp": 1, "ep": 5, "edp": 0}
    assert ParallelDims(2, 4, 4).coordinates(5) == {"dp": 1, "cp": 1, "ep": 1, "edp": 1}
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp\*cp=4.*\[1, 2, 4\]"):
        ParallelDims(2, 2, 3).check()
    with pytest.raises(
        ValueError, match=r"ep=4 does not divide the model's 6 routed experts.*one of \[1, 2\]"
    ):
        ParallelDims(4, 1, 4).check(num_experts=6)
    with pytest.raises(ValueError, match="dp=0"):
        ParallelDims(0, 1, 1).check()
    with pytest.raises(ValueError, match="does not divide the model's 8 routed experts"):  # the tiny preset
        check_layout(TrainConfig.load(None, ["model=tiny", "seq=512", "dp=3", "cp=2", "ep=6"]))
    with pytest.raises(ValueError, match="optimizer_offload=true runs on GPUs only"):
        check_layout(TrainConfig.load(None, ["model=tiny", "seq=512", "dp=2", "optimizer_offload=true"]))
    with pytest.raises(ValueError, match="needs fsdp=true"):
        check_layout(TrainConfig.load(None, ["model=tiny", "dp=2", "fsdp=false", "optimizer_offload=true"]))


@pytest.fixture(scope="module")
def fly_data(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("mesh") / "fly", "1-8192", 512)


def train_losses(data: Path, runs: Path, name: str, *settings: str) -> list[float]:
    """`genomelm train` on the tiny preset (3 steps unless set); the losses of metrics.jsonl in step order."""
    from genomelm.commands.train import main as train_main

    args = [
        f"data={data}",
        "seq=512",
        "model=tiny",
        f"run={name}",
        f"runs_dir={runs}",
        "steps=3",
        "warmup_steps=1",
        "lr=3e-3",
        "wandb=disabled",
        "rc_aug=0.5",
        *settings,
    ]
    assert train_main(args) == 0
    rows = [json.loads(row) for row in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return [
        row["loss"] for row in sorted({row["step"]: row for row in rows}.values(), key=lambda r: r["step"])
    ]


@pytest.mark.slow
def test_data_parallel_and_fsdp_equal_one_process(fly_data, tmp_path) -> None:
    """dp=2 (FSDP2, and plain all-reduce) and dp=2 x cp=2 on 4 ranks read the windows one process reads with
    grad_accum=2, and give its losses."""
    one = train_losses(fly_data, tmp_path, "one", "grad_accum=2")
    assert train_losses(fly_data, tmp_path, "dp2", "dp=2") == pytest.approx(one, rel=1e-5)
    assert train_losses(fly_data, tmp_path, "dp2-plain", "dp=2", "fsdp=false") == pytest.approx(one, rel=1e-5)
    assert train_losses(fly_data, tmp_path, "dp2cp2", "dp=2", "cp=2") == pytest.approx(one, rel=1e-5)
    assert train_losses(fly_data, tmp_path, "dp2ep2", "dp=2", "ep=2") == pytest.approx(one, rel=1e-5)
    windows = [
        json.loads(r)["windows"] for r in (tmp_path / "dp2cp2" / "metrics.jsonl").read_text().splitlines()
    ]
    assert windows == [
        json.loads(r)["windows"] for r in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    ]
    # the routed totals of rank 0's expert_load.json are every rank's: the one process's, to within a tie
    # of the router that the ranks' reduction order may flip
    one_load = json.loads((tmp_path / "one" / "expert_load.json").read_text())["counts"]
    for name in ("dp2", "dp2-plain", "dp2cp2", "dp2ep2"):
        load = json.loads((tmp_path / name / "expert_load.json").read_text())["counts"]
        assert load.keys() == one_load.keys()
        for layer, counts in load.items():
            assert sum(counts) == sum(one_load[layer])
            assert counts == pytest.approx(one_load[layer], abs=2)


@pytest.mark.slow
def test_context_and_expert_parallel_on_two_ranks_equal_one_process(fly_data, tmp_path) -> None:
    """cp=2 x ep=2 on 2 ranks: each window split over both, the experts too; bf16 FSDP (bf16 parameters,
    fp32 reduction) under CPU autocast stays within bf16 rounding of one bf16 process."""
    one = train_losses(fly_data, tmp_path, "one", "steps=2")
    assert train_losses(fly_data, tmp_path, "cp2ep2", "cp=2", "ep=2", "steps=2") == pytest.approx(
        one, rel=1e-5
    )
    one_bf16 = train_losses(fly_data, tmp_path, "one-bf16", "steps=2", "precision=bf16", "grad_accum=2")
    dp2_bf16 = train_losses(fly_data, tmp_path, "dp2-bf16", "steps=2", "precision=bf16", "dp=2", "ep=2")
    assert dp2_bf16 == pytest.approx(one_bf16, rel=4 * 2**-8)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_at_other_world_sizes_and_placements(fly_data, tmp_path) -> None:
    """Saved by 2 ranks (dp=2 x ep=2, FSDP2), killed at step 3; resumed by one process (grad_accum=2), by 2
    ranks with each MoE layer's experts placed by the routed load of steps 1-2 (`expert_placement=balanced`),
    and by 4 ranks (dp=2 x cp=2, ep=4: the experts resharded) placed so with a copy slot per rank
    (`expert_copies=1`): steps 3 and 4 equal the uninterrupted run's, and so do the last checkpoints, the
    placed runs' saved from their placed experts."""
    full = train_losses(fly_data, tmp_path, "full", "dp=2", "ep=2", "steps=4", "save_every=2")
    from genomelm.train.faults import FAULT_ENV

    resumes = (
        ("at4", ["dp=2", "cp=2", "ep=4", "expert_placement=balanced", "expert_copies=1"]),
        ("at1", ["grad_accum=2"]),
        ("placed", ["dp=2", "ep=2", "expert_placement=balanced"]),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, "3:1")
        with pytest.raises(AssertionError, match="assert 1 == 0"):  # the lost rank: exit status 1
            train_losses(fly_data, tmp_path, "killed", "dp=2", "ep=2", "steps=4", "save_every=2")
    step_dir = tmp_path / "killed" / "checkpoints" / "step-0000002"
    assert (step_dir / "state" / ".metadata").exists() and not (step_dir / "model").exists()
    for name, resumed in resumes:
        # the killed run's folder, resumed under each name (a run's name is not part of what it resumes)
        shutil.copytree(tmp_path / "killed", tmp_path / name)
        # as a kill -9 mid-save leaves it
        half_written = tmp_path / name / "checkpoints" / ".tmp-step-0000004" / "state"
        half_written.mkdir(parents=True)
        (half_written / "__0_0.distcp").write_bytes(b"\0" * 100)
        losses = train_losses(fly_data, tmp_path, name, *resumed, "steps=4", "save_every=2")
        assert losses[:2] == pytest.approx(full[:2], rel=1e-6)  # rows the killed run logged
        assert losses[2:] == pytest.approx(full[2:], rel=1e-5), name
        assert not half_written.parent.exists()  # removed by the resumed run, never read
    placement = json.loads((tmp_path / "placed" / "expert_placement.json").read_text())
    assert placement["ep"] == 2 and placement["load_through_step"] == 2
    assert sorted(placement["layers"]) == ["1", "2", "3"]  # tiny's MoE layers
    layers = placement["layers"].values()
    assert any(layer["slots"] != [[0, 1, 2, 3], [4, 5, 6, 7]] for layer in layers)  # not the static blocks
    assert all(layer["placed"] <= layer["static"] for layer in layers)
    with_copies = json.loads((tmp_path / "at4" / "expert_placement.json").read_text())["layers"].values()
    assert any(len(rank) == 3 for layer in with_copies for rank in layer["slots"])  # 2 owned + a copy
    from genomelm.model import load_model

    final = {
        name: load_model(tmp_path / name / "checkpoints" / "step-0000004" / "model").state_dict()
        for name in ("full", "at4", "placed")
    }  # the Hugging Face copies of the last checkpoints
    for name in ("at4", "placed"):  # the copies are not in a checkpoint: their owners' weights are
        for key, value in final["full"].items():
            torch.testing.assert_close(final[name][key], value, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.slow
def test_each_rank_reads_its_shard_of_a_model_folder(fly_data, tmp_path) -> None:
    """model=<Hugging Face folder> at dp=2 x ep=2: each rank builds the model empty and reads only its rows
    and experts; the losses equal those of the same weights built whole (the preset's saved init)."""
    whole = train_losses(fly_data, tmp_path, "whole", "dp=2", "ep=2", "steps=2")
    folder = tmp_path / "whole" / "init"  # the preset's random weights, saved before training
    assert train_losses(fly_data, tmp_path, "read", f"model={folder}", "dp=2", "ep=2", "steps=2") == whole
