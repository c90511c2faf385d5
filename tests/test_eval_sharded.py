"""`genomelm eval` on the training's mesh: dp x cp x ep ranks, the model split as in training, each rank
reading only its shard from a Hugging Face folder or from the run's sharded checkpoint, the dp replicas
scoring different windows. Its buckets equal a one-process evaluation of the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import fly_windows

from genomelm.commands.eval import main as eval_main
from genomelm.parallel.checkpoint import Checkpointer
from genomelm.run.config import TrainConfig
from genomelm.run.scoring import (
    ScoringRun,
    WindowShare,
    load_scoring_model,
    scoring_dtype,
    scoring_source,
)

HELDOUT = "200001-201280"  # 5 held-out windows of 256 tokens: an odd count, so dp 2 replicas get 3 and 2


@pytest.mark.parametrize("total, size", [(5, 2), (1, 2), (7, 4), (4, 2), (3, 1)])
def test_window_share_scores_each_window_once_in_equal_passes(total: int, size: int) -> None:
    passes = [WindowShare(rank, size).passes(total) for rank in range(size)]
    assert {len(p) for p in passes} == {-(-total // size)}  # every replica runs as many passes
    counted = sorted(index for p in passes for index, kept in p if kept)
    assert counted == list(range(total))  # each window scored once
    assert all(index < total for p in passes for index, _ in p)


def test_window_share_returns_results_in_job_order() -> None:
    calls = []
    jobs = [lambda i=i: calls.append(i) or i * i for i in range(4)]
    progress = []
    assert WindowShare().run(jobs, lambda done, total: progress.append((done, total))) == [0, 1, 4, 9]
    assert calls == [0, 1, 2, 3] and progress == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_scoring_model_is_stored_in_the_run_precision(tmp_path: Path) -> None:
    assert scoring_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert scoring_dtype("auto", torch.device("cpu")) == torch.float32
    config = TrainConfig.load(None, ["model=tiny", "precision=bf16"])
    model = load_scoring_model("tiny", config, ScoringRun.from_environment(config))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["embed_tokens.weight"] == torch.bfloat16  # no fp32 copy of a bf16 run's weights
    assert torch.float32 in dtypes.values()  # the fp32-declared parameters (router, KDA gates) stay fp32
    assert not model.training


def train_sharded(root: Path, model: str) -> list[str]:
    """A run of `model` trained for 2 steps on dp 2 x ep 2 ranks in `root`: its settings. Its checkpoints
    (steps 1 and 2) are sharded and no Hugging Face export of them is written."""
    from genomelm.commands.train import launch_training

    data = fly_windows(root / "fly", "1-4096", 256, heldout=HELDOUT)
    run = [
        f"data={data}",
        "seq=256",
        f"model={model}",
        "run=r",
        f"runs_dir={root / 'runs'}",
        "steps=2",
        "save_every=1",
        "warmup_steps=1",
        "lr=3e-3",
        "wandb=disabled",
        "bucket=64",
    ]
    launch_training(TrainConfig.load(None, [*run, "dp=2", "ep=2", "export_final=false"]))
    step = Checkpointer(root / "runs" / "r").latest()
    assert Checkpointer.is_sharded(step) and not (step / "model").exists()
    return run


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return train_sharded(tmp_path_factory.mktemp("sharded"), "tiny")


def _buckets(run: list[str], results: Path, *layout: str) -> dict:
    assert eval_main([*run, f"results_dir={results}", *layout]) == 0
    return json.loads((results / "r" / "buckets.json").read_text())


def check_eight_equal_one(run: list[str], tmp_path: Path) -> dict:
    """The run's buckets at dp 2 x cp 2 x ep 2 against one process (5 windows over 2 replicas). Before: the
    run's init, a Hugging Face folder each rank reads its shard of; after: the sharded checkpoint, read
    directly (whole in one process, by shard on 8 ranks). Returns the one-process result."""
    one = _buckets(run, tmp_path / "one")
    eight = _buckets(run, tmp_path / "eight", "dp=2", "cp=2", "ep=2", "cp_layout=contiguous")
    assert one["provenance"]["after_model"].endswith("step-0000002")  # the sharded step folder itself
    assert eight["provenance"] == one["provenance"] | {"timestamp": eight["provenance"]["timestamp"]}
    assert eight["settings"] == one["settings"] and one["settings"]["windows"] == 5
    for a, b in zip(one["buckets"], eight["buckets"], strict=True):
        for model in ("before", "after"):
            assert b[model]["tokens"] == a[model]["tokens"]
            assert b[model]["loss"] == pytest.approx(a[model]["loss"], rel=1e-5)
            assert b[model]["se"] == pytest.approx(a[model]["se"], rel=1e-4)
    for model in ("before", "after"):
        assert eight["context_cut"][model]["cut"] == pytest.approx(one["context_cut"][model]["cut"], rel=1e-5)
    return one


@pytest.mark.slow
def test_eval_on_dp2_cp2_ep2_equals_one_process(sharded_run: list[str], tmp_path: Path, capsys) -> None:
    one = check_eight_equal_one(sharded_run, tmp_path)
    capsys.readouterr()
    change = [row["change"] for row in one["buckets"]]
    assert np.all(np.isfinite(change)) and np.mean(change) < 0  # the trained model is better


@pytest.mark.slow
def test_small_eval_on_dp2_cp2_ep2_equals_one_process(tmp_path: Path, capsys) -> None:
    check_eight_equal_one(train_sharded(tmp_path / "run", "small"), tmp_path)
    capsys.readouterr()


@pytest.mark.slow
def test_probe_on_dp2_ep2_equals_one_process(sharded_run: list[str], tmp_path: Path, capsys) -> None:
    from genomelm.commands.probe import main as probe_main

    results = {}
    for name, layout in (("one", []), ("two", ["dp=2", "ep=2"])):
        settings = [
            *sharded_run,
            f"results_dir={tmp_path / name}",
            "probe_length=16",
            "probe_distances=16,64",
        ]
        assert probe_main([*settings, "probe_windows=3", *layout]) == 0
        results[name] = json.loads((tmp_path / name / "r" / "copy_probe.json").read_text())
    capsys.readouterr()
    for a, b in zip(results["one"]["distances"], results["two"]["distances"], strict=True):
        assert (b["windows"], b["tokens"]) == (a["windows"], a["tokens"]) == (3, 45)
        for model in ("before", "after"):
            assert b[model] == pytest.approx(a[model], rel=1e-5, abs=1e-6)


def test_a_damaged_sharded_checkpoint_falls_back_to_the_one_before(
    sharded_run: list[str], tmp_path: Path
) -> None:
    config = TrainConfig.load(None, sharded_run)
    first, newest = Checkpointer(config.run_dir).complete()
    run = ScoringRun.from_environment(config)
    assert scoring_source(str(newest), run) == str(newest)
    shard = sorted((newest / "state").glob("*.distcp"))[0]
    copy = tmp_path / "intact.distcp"
    copy.write_bytes(shard.read_bytes())
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    try:
        with pytest.warns(UserWarning, match=f"damaged, using {first} instead.*{shard.name}"):
            assert scoring_source(str(newest), run) == str(first)
    finally:
        shard.write_bytes(copy.read_bytes())  # the other tests read this run


def test_layouts_the_evaluation_cannot_run_are_refused_before_any_process_starts(capsys) -> None:
    base = ["model=tiny", "seq=256", "run=r", "--before", "tiny", "--after", "tiny"]
    assert eval_main([*base, "dp=2", "ep=3"]) == 2
    assert "ep=3" in capsys.readouterr().err
    assert eval_main([*base, "cp=2", "bucket=96"]) == 2  # the cut window: 256 - 192 + 96 = 160 tokens
    err = capsys.readouterr().err
    assert "the context cut scores the last bucket with the one before it, 160 tokens" in err
    assert "context_cut=false" in err
