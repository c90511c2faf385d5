"""Training data options on real fly DNA: reverse-complement augmentation, soft-mask loss weights, blended
datasets and sequence-length warm-up, each exact on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows

from genomelm.data.errors import DataError
from genomelm.parallel.checkpoint import Checkpointer
from genomelm.run.config import TrainConfig
from genomelm.train.feed import TrainingData
from genomelm.train.loop import train


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "a": fly_windows(root / "a", "1-2048", 256),  # 8 windows, 26% soft-masked
        "b": fly_windows(root / "b", "4097-6144", 256),  # 8 windows
        "short": fly_windows(root / "short", "700001-701024", 128),
    }


def settings(tmp_path: Path, **overrides) -> TrainConfig:
    values = {
        "run": "t",
        "model": "tiny",
        "seq": "256",
        "steps": 4,
        "lr": 3e-3,
        "warmup_steps": 1,
        "save_every": 2,
        "wandb": "disabled",
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    }
    values.update(overrides)
    return TrainConfig.load(None, [f"{k}={v}" for k, v in values.items()])


def metrics(cfg: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reverse_complement_windows(tmp_path, folders) -> None:
    from genomelm.data.tokens import reverse_complement

    data = TrainingData(settings(tmp_path, data=folders["a"], rc_aug=1.0))
    window = data.next(0, 0)
    plain = data.datasets[0][window.index]
    ids, _ = reverse_complement(plain.ids, plain.softmask, data.vocab)
    assert window.reverse and torch.equal(window.input_ids, ids)
    assert torch.equal(window.labels[:-1], ids[1:]) and window.labels[-1] == -100
    never = TrainingData(settings(tmp_path, data=folders["a"], rc_aug=0.0))
    assert not any(never.next(s, 0).reverse for s in range(8))
    half = TrainingData(settings(tmp_path, data=folders["a"], rc_aug=0.5))
    flips = [half.next(s, 0).reverse for s in range(8)]
    assert any(flips) and not all(flips)


def test_softmask_weights(tmp_path, folders) -> None:
    data = TrainingData(settings(tmp_path, data=folders["a"], softmask_weight=0.1))
    for step in range(8):  # a window with both repeats and unique sequence
        window = data.next(step, 0)
        row = data.datasets[0][window.index]
        if row.softmask[1:].any() and not row.softmask[1:].all():
            break
    predicted_masked = row.softmask[1:]
    valid = row.labels[:-1] != -100
    expected = torch.where(predicted_masked, 0.1, 1.0).masked_fill(~valid, 0.0)
    assert predicted_masked.any() and (~predicted_masked).any()
    weights = window.loss_weights(data.config.data_options.softmask_weight)
    torch.testing.assert_close(weights[:-1], expected)
    assert weights[-1] == 0


def test_weighted_loss_is_logged_beside_the_unweighted(tmp_path, folders) -> None:
    from genomelm.model import load_model

    cfg = settings(tmp_path, data=folders["a"], steps=1, softmask_weight=0.1)
    train(cfg, progress=False)
    row = metrics(cfg)[0]
    model = load_model(str(cfg.run_dir / "init"))  # the weights of the first step
    window = TrainingData(cfg).next(0, 0)
    with torch.no_grad():
        nll = model(window.input_ids[None], window.labels[None], reduction="none")[0]
    valid, weights = window.labels != -100, window.loss_weights(0.1)
    assert row["loss_weighted"]
    assert row["loss"] == pytest.approx(float((nll * weights).sum() / weights.sum()), rel=1e-5)
    assert row["loss_unweighted"] == pytest.approx(float(nll[valid].mean()), rel=1e-5)


def test_blend_draws_by_weight_and_refuses_other_lengths(tmp_path, folders) -> None:
    cfg = settings(tmp_path, data=f"{folders['a']}:0.75,{folders['b']}:0.25")
    data = TrainingData(cfg)
    sources = [data.next(step, 0).source for step in range(8)]
    assert sources.count("a") == 6 and sources.count("b") == 2
    with pytest.raises(DataError, match=r"256 tokens but .*short has 128"):
        TrainingData(settings(tmp_path, data=f"{folders['a']},{folders['short']}"))


def test_sequence_warmup_crops(tmp_path, folders) -> None:
    cfg = settings(
        tmp_path, data=folders["a"], seq_warmup_steps=4, seq_warmup_start=64, steps=6, save_every=100
    )
    train(cfg, progress=False)
    assert [row["tokens"][0] for row in metrics(cfg)] == [64, 64, 128, 128, 256, 256]


def test_options_resume_exactly(tmp_path, folders, monkeypatch) -> None:
    options = {
        "data": f"{folders['a']}:0.5,{folders['b']}:0.5",
        "rc_aug": 0.5,
        "softmask_weight": 0.1,
        "seq_warmup_steps": 2,
        "seq_warmup_start": 128,
    }
    whole = settings(tmp_path / "whole", **options)
    reference = train(whole, progress=False)["losses"]
    broken = settings(tmp_path / "broken", **options)
    real_save = Checkpointer.save

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(broken, progress=False)
    monkeypatch.setattr(Checkpointer, "save", real_save)
    resumed = train(broken, progress=False)
    assert resumed["start_step"] == 2
    assert resumed["losses"] == reference[2:]
    assert [r["sources"] for r in metrics(broken)] == [r["sources"] for r in metrics(whole)]
