"""Shared helpers for the training tests: a short `tiny` run's settings, and a run cut short right after its
first checkpoint (as Ctrl-C there would)."""

from __future__ import annotations

from pathlib import Path

import pytest

from genomelm.parallel.checkpoint import Checkpointer
from genomelm.run.config import TrainConfig
from genomelm.train.loop import train


def short_run_settings(tmp_path: Path, data: Path, **overrides: object) -> list[str]:
    """`key=value` settings, as `genomelm train` takes them, of a 6-step run "t" of the `tiny` preset on the
    128-token windows in `data`, saving every 3 steps, under `tmp_path`."""
    values = {
        "run": "t",
        "model": "tiny",
        "data": str(data),
        "seq": 128,
        "steps": 6,
        "lr": 3e-3,
        "warmup_steps": 2,
        "save_every": 3,
        "wandb": "disabled",
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    } | overrides
    return [f"{key}={value}" for key, value in values.items()]


def short_run(tmp_path: Path, data: Path, *extra: str, **overrides: object) -> TrainConfig:
    """`short_run_settings` loaded, with `extra` settings after them."""
    return TrainConfig.load(None, short_run_settings(tmp_path, data, **overrides) + list(extra))


def train_until_first_save(config: TrainConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train `config` and interrupt it (KeyboardInterrupt) right after its first checkpoint is written."""
    real_save = Checkpointer.save

    def save_then_interrupt(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Checkpointer, "save", save_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            train(config, progress=False)
