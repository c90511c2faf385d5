"""A run folder has one owner and one run: the lock, resume=never over an earlier run, a torn metrics line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_fixtures import fly_windows

from genomelm.train.config import TrainConfig
from genomelm.train.guards import RunMismatch
from genomelm.train.loop import train
from genomelm.train.metrics import read_metrics
from genomelm.train.run_lock import LOCK_FILE, RunLock, RunLocked

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("data") / "fly", "1-4096", 512)


def settings(fly: Path, tmp_path: Path, **overrides) -> list[str]:
    values = {
        "data": fly,
        "seq": 512,
        "model": "tiny",
        "run": "r",
        "runs_dir": tmp_path / "runs",
        "wandb": "disabled",
        "warmup_steps": 1,
        "steps": 2,
        "save_every": 2,
    } | overrides
    return [f"{key}={value}" for key, value in values.items()]


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["started"]
        with pytest.raises(RunLocked, match=f"in use by pid {os.getpid()} on .* run=NAME"):
            RunLock(run_dir).acquire()
    assert not (run_dir / LOCK_FILE).exists()  # released
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": RunLock(run_dir).owner["host"]}))
    with pytest.warns(UserWarning, match=f"taking over the lock of pid {gone.pid}"), RunLock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": "another-host"}))
    with pytest.raises(RunLocked, match="another-host"):  # this host cannot tell whether it still runs
        RunLock(run_dir).acquire()


@pytest.mark.slow
def test_second_train_on_a_running_cp2_run_is_refused(fly: Path, tmp_path: Path) -> None:
    """`genomelm train cp=2` holds the lock while its ranks train; a second `genomelm train` on the same run
    is refused naming the holder, and writes nothing; after a kill -9 of the first, a third takes the stale
    lock over and trains."""
    command = [sys.executable, "-m", "genomelm.cli", "train"]
    busy = settings(fly, tmp_path, cp=2, steps=100_000, save_every=100_000)
    first = subprocess.Popen(
        [*command, *busy],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    lock, metrics = tmp_path / "runs" / "r" / LOCK_FILE, tmp_path / "runs" / "r" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not metrics.exists():  # the ranks are training
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        rows_before = len(read_metrics(metrics))
        second = subprocess.run([*command, *busy], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"in use by pid {first.pid}" in second.stderr and "run=NAME" in second.stderr
        assert json.loads(lock.read_text())["pid"] == first.pid
        assert first.poll() is None and len(read_metrics(metrics)) >= rows_before  # the first run goes on
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert json.loads(lock.read_text())["pid"] == first.pid  # a kill -9 leaves its lock behind
    third = subprocess.run(
        [*command, *settings(fly, tmp_path, steps=1)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert third.returncode == 0, third.stderr
    assert f"taking over the lock of pid {first.pid}" in third.stderr
    assert not lock.exists()


def test_resume_never_over_an_earlier_run_is_refused(fly: Path, tmp_path: Path) -> None:
    """A longer earlier run in the folder: resume=never would have its new checkpoints pruned at once."""
    train(TrainConfig.load(None, settings(fly, tmp_path, steps=4)), progress=False)
    again = TrainConfig.load(None, settings(fly, tmp_path, steps=2, resume="never", lr=1e-2))
    with pytest.raises(RunMismatch, match=r"resume=never.*step-0000004.*resume=auto.*run=NAME"):
        train(again, progress=False)
    assert [row["step"] for row in read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_torn_metrics_line_is_skipped_and_repaired_on_resume(fly: Path, tmp_path: Path) -> None:
    """A disk full during an append leaves half a row: readers skip it with a warning, a resume rewrites the
    file without it and goes on."""
    config = TrainConfig.load(None, settings(fly, tmp_path, steps=2))
    train(config, progress=False)
    metrics = config.run_dir / "metrics.jsonl"
    with open(metrics, "a") as out:
        out.write('{"step": 3, "loss": 2.0')
    with pytest.warns(UserWarning, match="torn last line"):
        assert [row["step"] for row in read_metrics(metrics)] == [1, 2]
    with pytest.warns(UserWarning, match="torn last line"):
        train(config.replace(steps=3), progress=False)
    assert [row["step"] for row in read_metrics(metrics)] == [1, 2, 3]
    metrics.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not a metrics row"):
        read_metrics(metrics)


@pytest.mark.slow
def test_rerun_finishes_a_final_export_a_kill_cut_short(fly: Path, tmp_path: Path) -> None:
    """A cp=2 run killed while rank 0 exported its last checkpoint has `step-N/` without `model/`: running it
    again writes the export (and says there is nothing left to train) instead of exiting with nothing done."""
    from genomelm.train.command import main as train_main

    run = settings(fly, tmp_path, cp=2, steps=2, save_every=2)
    assert train_main(run) == 0
    final = tmp_path / "runs" / "r" / "checkpoints" / "step-0000002"
    exported = {
        p.relative_to(final / "model"): p.read_bytes() for p in (final / "model").rglob("*") if p.is_file()
    }
    shutil.rmtree(final / "model")  # as a kill during the export leaves it (the export is renamed in last)
    assert train_main(run) == 0
    assert {
        p.relative_to(final / "model"): p.read_bytes() for p in (final / "model").rglob("*") if p.is_file()
    } == (exported)
