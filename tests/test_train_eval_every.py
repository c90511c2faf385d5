"""Held-out loss during training (`eval_every=N`) on real fly DNA with the `tiny` preset: the training is the
same with and without it, the logged buckets are those `genomelm eval`'s scoring gives the checkpoint of that
step, W&B gets a series per bucket and the figure, a run without held-out windows stops before its first
step, and the training-curves notebook draws it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import fly_windows, tiny_run
from test_notebooks import outputs, run_notebook

from genomelm.commands.train import main as train_main
from genomelm.data import WindowDataset
from genomelm.eval.buckets import bucketed_loss
from genomelm.eval.evaluate import load_heldout
from genomelm.model import load_model
from genomelm.run.config import TrainConfig
from genomelm.run.metrics import (
    HELDOUT_LOSS,
    heldout_bucket_key,
    heldout_buckets,
    heldout_se_key,
    read_metrics,
)
from genomelm.run.scoring import ScoringRun, load_scoring_model, score_windows
from genomelm.train import heldout as heldout_module
from genomelm.train.guards import RunMismatch
from genomelm.train.heldout import HeldoutEval, bucket_means, paired_change
from genomelm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
BUCKET = 128  # 4 buckets of the 512-token windows
EVAL = {"eval_every": 2, "bucket": BUCKET, "eval_windows": 2}  # windows 0 and 2 of the 3 held out


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    """8 training and 3 held-out windows of 512 bases."""
    return fly_windows(tmp_path_factory.mktemp("data") / "fly", "1-4096", 512, heldout="200001-201536")


def run_settings(data: Path, runs_dir: Path, **overrides: object) -> list[str]:
    """4 steps of the tiny preset with augmentation draws, every checkpoint kept."""
    base = {"steps": 4, "lr": 3e-3, "rc_aug": 0.5, "keep_checkpoints": 0}
    return tiny_run(data, runs_dir, **(base | overrides))


@pytest.fixture(scope="module")
def runs(fly, tmp_path_factory) -> dict[str, TrainConfig]:
    """The same run without held-out evaluation and with it every 2 steps (logging every 3 steps, W&B
    offline), each trained once."""
    root = tmp_path_factory.mktemp("runs")
    plain = TrainConfig.load(None, run_settings(fly, root / "plain"))
    evaluated = TrainConfig.load(
        None, run_settings(fly, root / "eval", **EVAL, log_every=3, save_every=2, wandb="offline")
    )
    return {
        "plain": plain,
        "eval": evaluated,
        "plain_losses": train(plain, progress=False)["losses"],
        "eval_losses": train(evaluated, progress=False)["losses"],
    }


def test_eval_every_leaves_the_training_unchanged(runs) -> None:
    assert len(runs["plain_losses"]) == 4
    assert runs["eval_losses"] == runs["plain_losses"]  # bit for bit
    rows = read_metrics(runs["eval"].run_dir / "metrics.jsonl")
    # steps 2 and 4 evaluated (logged whatever log_every=3 says), step 3 is a log_every row, step 1 neither
    assert [row["step"] for row in rows] == [2, 3, 4]
    assert [HELDOUT_LOSS in row for row in rows] == [True, False, True]
    assert [row["loss"] for row in rows] == [runs["plain_losses"][i] for i in (1, 2, 3)]


def test_logged_buckets_equal_scoring_the_checkpoint_of_that_step(runs, fly) -> None:
    config = runs["eval"]
    rows = {row["step"]: row for row in read_metrics(config.run_dir / "metrics.jsonl")}
    heldout = load_heldout(fly, config.eval.eval_windows)  # genomelm eval's choice of the windows
    assert [w["index"] for w in heldout.provenance["windows"]] == [0, 2]
    scoring = ScoringRun.from_environment(config)
    for step in (2, 4):
        model = load_scoring_model(
            str(config.run_dir / "checkpoints" / f"step-{step:07d}" / "model"), config, scoring
        )
        scores = score_windows(model, heldout.windows, BUCKET, False, precision=config.memory.precision)
        expected = bucketed_loss(scores.loss, scores.valid, scores.softmask, BUCKET)
        logged = rows[step]
        assert heldout_buckets(logged) == [
            (b["start"], b["end"], pytest.approx(b["loss"], rel=1e-6)) for b in expected
        ]
        for b in expected:
            assert logged[heldout_se_key(b["start"], b["end"])] == pytest.approx(b["se"], rel=1e-4)
        tokens = sum(b["tokens"] for b in expected)
        overall = sum(b["loss"] * b["tokens"] for b in expected) / tokens
        assert logged[HELDOUT_LOSS] == pytest.approx(overall, rel=1e-6)
        assert logged["heldout/tokens"] == tokens and logged["heldout/windows"] == 2
    assert rows[4][HELDOUT_LOSS] != pytest.approx(rows[2][HELDOUT_LOSS], rel=1e-4)  # another model
    # the paired change since step 2: on the same tokens, the ratio of the two losses
    assert "heldout/change" not in rows[2] and rows[4]["heldout/change_from_step"] == 2
    change = rows[4][HELDOUT_LOSS] / rows[2][HELDOUT_LOSS] - 1
    assert rows[4]["heldout/change"] == pytest.approx(change, rel=1e-9)
    assert rows[4]["heldout/change_low"] < rows[4]["heldout/change"] < rows[4]["heldout/change_high"]


def test_wandb_gets_a_series_per_bucket_and_the_figure(runs) -> None:
    (offline,) = (runs["eval"].run_dir / "wandb").glob("offline-run-*")
    images = sorted((offline / "files" / "media" / "images" / "heldout").glob("loss_by_position_*.png"))
    assert len(images) == 2  # steps 2 and 4
    history = next(offline.glob("*.wandb")).read_bytes()
    for start in range(0, 512, BUCKET):
        assert heldout_bucket_key(start, start + BUCKET).encode() in history
        assert heldout_se_key(start, start + BUCKET).encode() in history


def test_training_curves_notebook_draws_heldout_buckets(runs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("METRICS", str(runs["eval"].run_dir / "metrics.jsonl"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    nb = run_notebook("training_curves.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "held-out loss at 2 steps (2, 4), 4 buckets, 2 windows" in text
    assert len(outputs(nb, "png")) == 2  # the training curves, and the held-out buckets


def test_eval_every_without_heldout_windows_stops_before_training(fly, tmp_path, monkeypatch, capsys) -> None:
    real_len = WindowDataset.__len__
    # `genomelm data` refuses to write an empty held-out split; a folder from elsewhere may hold one
    monkeypatch.setattr(
        WindowDataset, "__len__", lambda self: 0 if self.split == "heldout" else real_len(self)
    )
    settings = run_settings(fly, tmp_path / "runs", eval_every=2)
    with pytest.raises(RunMismatch, match=f"{fly} has none.*heldout=.*eval_every=0"):
        train(TrainConfig.load(None, settings), progress=False)
    assert not (tmp_path / "runs").exists()  # no model was built, nothing written
    assert train_main(settings) == 2
    assert "eval_every=2 scores held-out windows, but" in capsys.readouterr().err


def test_eval_every_with_a_bucket_longer_than_the_windows_stops_before_training(fly, tmp_path) -> None:
    settings = run_settings(fly, tmp_path / "runs", eval_every=2, bucket=1024)
    with pytest.raises(RunMismatch, match=r"bucket=1024 is larger than .* \(512 tokens\); use bucket<=512"):
        train(TrainConfig.load(None, settings), progress=False)


def test_heldout_eval_restores_every_rng_and_training_mode(fly, tmp_path, monkeypatch) -> None:
    config = TrainConfig.load(None, run_settings(fly, tmp_path, **EVAL))
    heldout = HeldoutEval.for_run(config, None, torch.device("cpu"))
    real_score = heldout_module.score_windows

    def score_drawing_randoms(*args, **kwargs):  # a scorer that draws from every stream
        torch.rand(3)
        np.random.rand(3)
        random.random()
        return real_score(*args, **kwargs)

    monkeypatch.setattr(heldout_module, "score_windows", score_drawing_randoms)

    def seeded_model() -> torch.nn.Module:
        torch.manual_seed(7)
        np.random.seed(7)
        random.seed(7)
        return load_model("tiny").train()

    seeded_model()
    expected = (torch.rand(4), np.random.rand(4), random.random())
    model = seeded_model()
    record = heldout.run(model, 1)
    assert model.training
    drawn = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1])
    assert drawn[2] == expected[2]
    assert record["heldout/windows"] == 2 and np.isfinite(record[HELDOUT_LOSS])


def test_bucket_means_equal_bucketed_loss() -> None:
    rng = np.random.default_rng(0)
    loss = rng.exponential(1.4, (5, 70)).astype(np.float32)
    valid = rng.random((5, 70)) > 0.2
    valid[:, 32:48] = False  # a bucket without tokens
    result = bucket_means(loss, valid, 16)  # 5 buckets, the last of 6 positions
    rows = bucketed_loss(loss, valid, np.zeros_like(valid), 16)
    bounds = [(r["start"], r["end"]) for r in rows]
    assert result.bounds == bounds == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    np.testing.assert_allclose([e.value for e in result.buckets], [r["loss"] for r in rows], rtol=1e-12)
    np.testing.assert_allclose([e.se for e in result.buckets], [r["se"] for r in rows], rtol=1e-12)
    assert np.isnan(result.buckets[2].value)
    assert result.overall.value == pytest.approx(float(loss[valid].astype(np.float64).mean()), rel=1e-12)
    # a later evaluation 10% lower on every window: the paired change is -10% with an interval of no width
    change = paired_change(result, bucket_means(loss * 0.9, valid, 16))
    assert (change.value, change.low, change.high) == pytest.approx((-0.1, -0.1, -0.1))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp=2", "cp=2"])
def test_two_ranks_train_the_same_with_eval_every(fly, tmp_path, mesh: str) -> None:
    """dp=2: the replicas split the 3 windows (one scores a filler pass); cp=2: each window is split over the
    ranks through the `ContextParallelScorer`; FSDP2 over both ranks either way. The logged buckets equal the
    run's checkpoint scored in one process."""
    key, value = mesh.split("=")
    losses = {}
    every_window = EVAL | {"eval_windows": 0}
    for name, extra in (("plain", {}), ("eval", {**every_window, "save_every": 2})):
        settings = run_settings(fly, tmp_path / name, **extra, **{key: value})
        assert train_main(settings) == 0
        rows = read_metrics(tmp_path / name / "r" / "metrics.jsonl")
        losses[name] = [row["loss"] for row in rows]
    assert losses["eval"] == losses["plain"]
    config = TrainConfig.load(None, run_settings(fly, tmp_path / "eval", **every_window))
    row = next(row for row in read_metrics(config.run_dir / "metrics.jsonl") if row["step"] == 2)
    step_2 = config.run_dir / "checkpoints" / "step-0000002"  # sharded: read whole in one process
    model = load_scoring_model(str(step_2), config, ScoringRun.from_environment(config))
    windows = load_heldout(fly, 0).windows
    scores = score_windows(model, windows, BUCKET, False, precision=config.memory.precision)
    expected = bucketed_loss(scores.loss, scores.valid, scores.softmask, BUCKET)
    assert heldout_buckets(row) == [
        (b["start"], b["end"], pytest.approx(b["loss"], rel=1e-5)) for b in expected
    ]
    assert row["heldout/windows"] == 3
