"""`genomelm train launcher=ray`: Ray Train workers (gloo, 2 CPU workers) train exactly as the local launcher,
and a worker killed mid-run restarts the group from the last complete checkpoint with the same losses. One
local Ray serves the whole module (its start-up is the slow part on a small machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from data_fixtures import fly_windows, step_losses
from local_ray import one_local_ray

from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 420  # per test; a Ray run of 5 steps takes ~1 min on 2 busy cores


@pytest.fixture(autouse=True)
def time_limit() -> Iterator[None]:
    """Fail a test that runs past TIMEOUT_S instead of hanging the suite (SIGALRM interrupts
    `trainer.fit`)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"test ran past {TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module", autouse=True)
def ray_turn() -> Iterator[None]:
    """The module's tests run the only local Ray on this machine (`one_local_ray`)."""
    with one_local_ray():
        yield


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    from genomelm.run.ray_launch import start_ray

    start_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    """16 training windows of 256 tokens of the bundled fly chromosome."""
    return fly_windows(tmp_path_factory.mktemp("ray") / "fly", "1-4096", 256)


def run_settings(data: Path, runs: Path, run: str, *extra: str) -> list[str]:
    return [
        f"data={data}",
        "seq=256",
        "model=tiny",
        f"run={run}",
        f"runs_dir={runs}",
        "steps=5",
        "save_every=2",
        "warmup_steps=1",
        "lr=3e-3",
        "wandb=disabled",
        "cp=2",
        "rc_aug=0.5",
        *extra,
    ]


@pytest.fixture(scope="module")
def local_losses(fly: Path, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the same run on the local launcher, uninterrupted."""
    from genomelm.commands.train import main as train_main

    runs = tmp_path_factory.mktemp("local-runs")
    assert train_main(run_settings(fly, runs, "local")) == 0
    losses = step_losses(runs, "local")
    assert sorted(losses) == [1, 2, 3, 4, 5]
    return losses


@pytest.fixture(scope="module")
def ray_run(ray_cluster: None, fly: Path, tmp_path_factory) -> tuple[list[str], dict]:
    """The same run as `local_losses` on Ray (no Hugging Face export: its sharded checkpoint is what
    `test_ray_eval_equals_one_process` scores): its settings and summary."""
    from genomelm.commands.train import launch_training

    runs = tmp_path_factory.mktemp("ray-runs")
    settings = run_settings(fly, runs, "ray", "export_final=false")
    return settings, launch_training(TrainConfig.load(None, [*settings, "launcher=ray"]))


@pytest.mark.slow
def test_ray_run_equals_local_launcher(
    ray_run: tuple[list[str], dict], local_losses: dict[int, float]
) -> None:
    settings, summary = ray_run
    runs = Path(TrainConfig.load(None, settings).runs_dir)
    assert summary["start_step"] == 0 and summary["steps"] == 5
    assert summary["checkpoint"] == runs / "ray" / "checkpoints" / "step-0000005"
    losses = step_losses(runs, "ray")
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert [losses[s] for s in range(1, 6)] == pytest.approx([local_losses[s] for s in range(1, 6)], rel=1e-6)
    assert summary["losses"] == pytest.approx([local_losses[s] for s in range(1, 6)], rel=1e-6)


@pytest.mark.slow
def test_killed_worker_restarts_from_last_checkpoint(
    ray_cluster: None, fly: Path, local_losses: dict[int, float], tmp_path: Path, monkeypatch
) -> None:
    """Rank 1 exits hard after step 3; checkpoints at steps 2 and 4: the group restarts from step 2, redoes
    step 3 and ends with the losses of the uninterrupted run."""
    from genomelm.commands.train import launch_training
    from genomelm.train.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "3:1")
    settings = run_settings(fly, tmp_path, "killed", "launcher=ray", "max_failures=1")
    summary = launch_training(TrainConfig.load(None, settings))
    assert (tmp_path / "killed" / ".fault-injected-step3-rank1").exists()  # the worker did die
    assert summary["start_step"] == 2 and summary["steps"] == 5  # the restarted group resumed at step 2
    losses = step_losses(tmp_path, "killed")
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert [losses[s] for s in range(1, 6)] == pytest.approx([local_losses[s] for s in range(1, 6)], rel=1e-6)


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_with_its_exit(
    ray_cluster: None, fly: Path, tmp_path: Path, monkeypatch
) -> None:
    """max_failures=0: the run stops at the first lost worker, and the error says which rank died."""
    from genomelm.commands.train import launch_training
    from genomelm.run.ray_launch import RayLaunchError
    from genomelm.train.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "1:1")
    settings = run_settings(fly, tmp_path, "lost", "launcher=ray", "steps=2")
    with pytest.raises(RayLaunchError, match="rank 1"):
        launch_training(TrainConfig.load(None, settings))


def test_ray_settings_refused_before_ray_starts(monkeypatch) -> None:
    from genomelm.commands import train as command

    monkeypatch.setattr(command, "on_ranks", None)  # nothing may start
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp\*cp=4"):  # the mesh checks run first
        command.launch_training(
            TrainConfig.load(None, ["model=tiny", "launcher=ray", "dp=2", "cp=2", "ep=3"])
        )
    with pytest.raises(ValueError, match="resume=auto"):
        command.launch_training(
            TrainConfig.load(None, ["model=tiny", "launcher=ray", "max_failures=1", "resume=never"])
        )
    with pytest.raises(ValueError, match="launcher must be one of local, ray, env, not 'slurm'"):
        command.launch_training(TrainConfig.load(None, ["model=tiny", "launcher=slurm"]))
    with pytest.raises(ValueError, match="multiple of 384 tokens"):  # the cp checks run first too
        command.launch_training(TrainConfig.load(None, ["model=tiny", "launcher=ray", "seq=16k", "cp=3"]))


def test_ray_trains_chatter_stays_quiet_after_ray_train_configures_its_loggers() -> None:
    import logging.config

    from genomelm.run.ray_logging import QUIET_LOGGERS, quiet_ray_loggers

    quiet_ray_loggers()
    # what Ray Train's controller and workers do on start (`LoggingManager`): it resets the levels below it
    logging.config.dictConfig(
        {"version": 1, "disable_existing_loggers": False, "loggers": {"ray.train": {"level": "DEBUG"}}}
    )
    client = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
    logger = sys.modules[client].logger
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("Failed to send resource request", exc_info=True)
        logger.error("an error still shows")
    finally:
        logger.removeHandler(handler)
    assert shown == ["an error still shows"]
    assert QUIET_LOGGERS[client] == logging.ERROR


@pytest.mark.slow
def test_sigterm_to_the_driver_stops_the_workers_after_a_step_with_a_checkpoint(
    fly: Path, tmp_path: Path
) -> None:
    """The Ray driver gets SIGTERM (as Kubernetes or Slurm send it): it asks the workers to stop (the run
    folder's stop file), they checkpoint the step they finished, and the driver exits 0 saying how to go
    on."""
    from genomelm.parallel.checkpoint import Checkpointer
    from genomelm.run.stop import STOP_FILE

    settings = run_settings(fly, tmp_path, "stopped", "launcher=ray", "steps=1000", "save_every=1000")
    driver = subprocess.Popen(
        [sys.executable, "-m", "genomelm.cli", "train", *settings],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read()
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 143, err  # stopped early: 128 + SIGTERM
    step = int(out.split("stopped by SIGTERM after step ")[1].split()[0])
    assert Checkpointer(tmp_path / "stopped").latest().name == f"step-{step:07d}"
    assert len(metrics.read_text().splitlines()) == step
    assert not (tmp_path / "stopped" / STOP_FILE).exists()


@pytest.mark.slow
def test_ray_eval_equals_one_process(ray_run: tuple[list[str], dict], tmp_path: Path, capsys) -> None:
    """`genomelm eval launcher=ray dp=2 ep=2`: 2 Ray Train workers score a run trained on Ray (its sharded
    checkpoint, no Hugging Face export) as one local process does."""
    from genomelm.commands.eval import main as eval_main

    run = [*ray_run[0], "bucket=64"]
    buckets = {}
    for name, layout in (("ray", ["launcher=ray", "cp=1", "dp=2", "ep=2"]), ("one", ["cp=1"])):
        assert eval_main([*run, f"results_dir={tmp_path / name}", *layout]) == 0
        buckets[name] = json.loads((tmp_path / name / "ray" / "buckets.json").read_text())
    capsys.readouterr()
    assert buckets["ray"]["provenance"]["after_model"].endswith("step-0000005")
    for a, b in zip(buckets["one"]["buckets"], buckets["ray"]["buckets"], strict=True):
        for model in ("before", "after"):
            assert b[model]["loss"] == pytest.approx(a[model]["loss"], rel=1e-5)
