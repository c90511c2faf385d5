"""Which W&B run a genomelm run logs to: project, entity and group from the settings or W&B's variables, and
a fresh W&B id per run unless the run continues from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from genomelm.run.config import TrainConfig
from genomelm.run.wandb_run import WANDB_ID_FILE, wandb_init_args


@pytest.fixture(autouse=True)
def no_wandb_variables(monkeypatch) -> None:
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def config(tmp_path: Path, *settings: str) -> TrainConfig:
    return TrainConfig.from_args([f"runs_dir={tmp_path}", "run=r", "model=tiny", *settings])


def test_a_fresh_run_gets_a_new_id_and_a_continued_one_keeps_it(tmp_path: Path) -> None:
    first = wandb_init_args(config(tmp_path), resumed_step=0)
    assert first["resume"] is None and (tmp_path / "r" / WANDB_ID_FILE).read_text().strip() == first["id"]
    resumed = wandb_init_args(config(tmp_path), resumed_step=30)
    assert (resumed["id"], resumed["resume"]) == (first["id"], "allow")
    again = wandb_init_args(config(tmp_path), resumed_step=0)  # a new run under the old name
    assert again["id"] != first["id"] and again["resume"] is None
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [WANDB_ID_FILE]  # no temporary left


def test_project_entity_and_group_from_settings_else_the_variables(tmp_path: Path, monkeypatch) -> None:
    plain = wandb_init_args(config(tmp_path), 0)
    assert (plain["project"], plain["entity"], plain["group"], plain["name"]) == ("genomelm", None, None, "r")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_RUN_ID", "fixed-id")
    env = wandb_init_args(config(tmp_path), 0)
    assert (env["project"], env["id"]) == ("from-env", "fixed-id")
    given = wandb_init_args(
        config(tmp_path, "wandb_project=p", "wandb_entity=lab", "log.wandb_group=sweep-1"), 0
    )
    assert (given["project"], given["entity"], given["group"]) == ("p", "lab", "sweep-1")
    assert given["config"]["log"]["wandb_group"] == "sweep-1"
