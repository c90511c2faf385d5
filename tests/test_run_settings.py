"""`runs/<run>/config.yaml`: the resolved settings written when `genomelm train` starts, loadable as the run
config that continues the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from data_fixtures import fly_windows, tiny_run

from genomelm.commands.train import main as train_main
from genomelm.run.config import TrainConfig
from genomelm.run.metrics import read_metrics
from genomelm.run.settings_file import SETTINGS_FILE, write_run_settings


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("fly") / "fly", "1-16384", 512)


def test_the_settings_file_continues_the_run(fly: Path, tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    assert train_main(tiny_run(fly, runs, lr="3e-3", steps=2)) == 0
    path = runs / "r" / SETTINGS_FILE
    text = path.read_text()
    assert f"# continue the run: genomelm train {path}" in text
    settings = yaml.safe_load(text)
    assert (
        settings["optim"]["lr"] == 0.003
        and settings["model"] == "tiny"
        and settings["log"]["wandb"] == "disabled"
    )
    assert TrainConfig.load(path) == TrainConfig.from_args(tiny_run(fly, runs, lr="3e-3", steps=2))
    assert train_main(tiny_run(fly, runs, run="refused", seq=1024)) == 2  # windows of 512: refused at start
    assert not (runs / "refused" / SETTINGS_FILE).exists()
    assert not list(path.parent.glob(f".{SETTINGS_FILE}*"))  # no temporary left

    capsys.readouterr()
    assert train_main([str(path), "steps=3"]) == 0  # the file as the run config, one more step
    assert "trained r: steps 2..3" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(runs / "r" / "metrics.jsonl")] == [1, 2, 3]
    assert yaml.safe_load(path.read_text())["optim"]["steps"] == 3  # rewritten at the continuation


def test_a_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    config = TrainConfig.from_args([f"runs_dir={tmp_path}", "model=tiny", "run=x"])
    path = write_run_settings(config)
    before = path.read_text()

    def refuse(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("genomelm.run.settings_file.os.replace", refuse)
    with pytest.raises(OSError):
        write_run_settings(config.replace(steps=9))
    assert path.read_text() == before and sorted(p.name for p in path.parent.iterdir()) == [SETTINGS_FILE]
