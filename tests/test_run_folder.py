"""A run folder has one owner and one run: the lock, resume=never over an earlier run, a torn metrics line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_fixtures import fly_windows, tiny_run

from genomelm.data.errors import file_system
from genomelm.parallel.checkpoint import Checkpointer
from genomelm.run.config import TrainConfig
from genomelm.run.lock import LOCK_FILE, RunLock, RunLocked
from genomelm.run.metrics import read_metrics
from genomelm.run.stop import STOP_FILE
from genomelm.train.guards import RunMismatch
from genomelm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("data") / "fly", "1-4096", 512)


def settings(fly: Path, tmp_path: Path, **overrides) -> list[str]:
    return tiny_run(fly, tmp_path / "runs", **overrides)


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["started"]
        with pytest.raises(RunLocked, match=f"in use by pid {os.getpid()} on .* run=NAME"):
            RunLock(run_dir).acquire()
    assert not run_dir.exists()  # released, and the folder it made removed: nothing was written there
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": RunLock(run_dir).owner["host"]}))
    with pytest.warns(UserWarning, match=f"taking over the lock of pid {gone.pid}"), RunLock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": "another-host"}))
    with pytest.raises(RunLocked, match="another-host"):  # this host cannot tell whether it still runs
        RunLock(run_dir).acquire()


def test_the_lock_is_taken_over_only_when_no_process_of_the_run_lives(tmp_path: Path) -> None:
    """A launcher killed outright leaves its ranks for a few seconds (they stop at their next step): the
    lock names them and is refused until none runs. A recorded pid now used by another process (another
    start time) is not the run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with RunLock(run_dir) as lock:
            lock.add_processes([rank.pid])
            held = json.loads((run_dir / LOCK_FILE).read_text())
        held["pid"] = gone.pid
        (run_dir / LOCK_FILE).write_text(json.dumps(held))
        with pytest.raises(RunLocked, match=f"still in use by pid {rank.pid} of the run pid {gone.pid}"):
            RunLock(run_dir).acquire()
        held["processes"] = [[rank.pid, held["processes"][0][1] - 100.0]]  # the pid, another process
        (run_dir / LOCK_FILE).write_text(json.dumps(held))
        with pytest.warns(UserWarning, match=f"taking over the lock of pid {gone.pid}"), RunLock(run_dir):
            pass
        (run_dir / LOCK_FILE).write_text(json.dumps(held | {"processes": [[rank.pid, 0.0]]}))
        rank.kill()
        rank.wait()
        with pytest.warns(UserWarning, match="which no longer runs"), RunLock(run_dir):
            pass
    finally:
        rank.kill()
        rank.wait()


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_node(tmp_path: Path, monkeypatch) -> None:
    """Slurm ends every process of a job before it requeues it; the job runs again under its id, usually on
    other nodes, and must not be refused by the lock its earlier run left."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"pid": 12345, "host": "gpu007", "slurm_job": "4242"}
    (run_dir / LOCK_FILE).write_text(json.dumps(earlier))
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job: refused
    with pytest.raises(RunLocked, match="in use by pid 12345 on gpu007"):
        RunLock(run_dir).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.warns(UserWarning, match="an earlier run of Slurm job 4242, requeued"), RunLock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["slurm_job"] == "4242"


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
        # the first run's processes stopped while the second starts: its lock is a live holder's all the
        # same, and the second gets the cores the ranks would spin on
        os.killpg(first.pid, signal.SIGSTOP)
        rows_before = len(read_metrics(metrics))
        second = subprocess.run([*command, *busy], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"in use by pid {first.pid}" in second.stderr and "run=NAME" in second.stderr
        assert json.loads(lock.read_text())["pid"] == first.pid
        os.killpg(first.pid, signal.SIGCONT)
        deadline = time.monotonic() + 180
        while len(read_metrics(metrics)) <= rows_before:  # the first run goes on
            assert first.poll() is None and time.monotonic() < deadline, "the first run stopped"
            time.sleep(0.2)
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


def test_the_only_checkpoint_damaged_is_refused_and_the_history_kept(
    fly: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """keep_checkpoints=1 (the demo's setting) and its one checkpoint damaged: `genomelm train` refuses to
    start the run over (exit 2), naming the damaged file and the way out; metrics.jsonl and the checkpoint are
    as they were."""
    from genomelm.commands.train import main as train_main

    run = settings(fly, tmp_path, keep_checkpoints=1)
    assert train_main(run) == 0
    metrics, checkpoint = tmp_path / "runs" / "r" / "metrics.jsonl", Checkpointer(tmp_path / "runs" / "r")
    rows = metrics.read_text()
    weights = next(checkpoint.latest().glob("model/*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])  # a truncated copy
    capsys.readouterr()
    assert train_main(settings(fly, tmp_path, keep_checkpoints=1, steps=4)) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("genomelm train: every checkpoint of") and len(line.splitlines()) == 1, line
    assert f"{weights}: " in line and "resume=never run=<new name>" in line
    assert metrics.read_text() == rows
    assert [p.name for p in checkpoint.steps()] == ["step-0000002"]


def test_a_full_disk_at_the_start_or_on_a_metrics_append_is_one_line(
    fly: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """ENOSPC (injected) while the run saves its initial model, then while it appends its second metrics row:
    one line each, naming the device, the path and the size needed, exit 1; the rows written stay."""
    from genomelm.commands.train import main as train_main
    from genomelm.run import metrics
    from genomelm.train import loop

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(loop, "save_model", full)
        assert train_main(settings(fly, tmp_path, run="start")) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    init = tmp_path / "runs" / "start" / "init"
    assert line.startswith(f"genomelm train: no space left on {file_system(tmp_path)} writing {init} (")
    assert "initial model (the 'before' model of genomelm eval) needs about " in line and " free)" in line
    appended = []

    def open_until_full(path, mode="r", *args, **kwargs):
        if mode == "a":
            appended.append(path)
            if len(appended) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", open_until_full, raising=False)
    assert train_main(settings(fly, tmp_path, run="rows", steps=4)) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    rows = tmp_path / "runs" / "rows" / "metrics.jsonl"
    assert line.startswith(
        f"genomelm train: no space left on {file_system(tmp_path)} writing {rows} (a metrics"
    )
    assert line.endswith(
        "the run's newest checkpoint is intact: free space, and the same command continues (resume=auto)"
    )
    assert [row["step"] for row in read_metrics(rows)] == [1]


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
    with pytest.warns(UserWarning, match="torn last line .* row of step 3: its step runs again"):
        train(config.replace(steps=3), progress=False)
    assert [row["step"] for row in read_metrics(metrics)] == [1, 2, 3]
    # the torn row of a step the resume does not run again keeps what was written of it
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join(rows[:-1]) + "\n" + rows[-1][: rows[-1].index(', "', 20) + 5])
    with pytest.warns(UserWarning, match="row of step 3: kept its fields before the tear, marked torn"):
        train(config.replace(steps=3), progress=False)
    last = read_metrics(metrics)[-1]
    assert last["step"] == 3 and last["torn"] and last["loss"] == json.loads(rows[-1])["loss"]
    metrics.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not a metrics row"):
        read_metrics(metrics)


@pytest.mark.slow
def test_rerun_finishes_a_final_export_a_kill_cut_short(fly: Path, tmp_path: Path) -> None:
    """A cp=2 run killed while rank 0 exported its last checkpoint has `step-N/` without `model/`: running it
    again writes the export (and says there is nothing left to train) instead of exiting with nothing done."""
    from genomelm.commands.train import main as train_main

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


def _wait_for_rows(metrics: Path, rows: int, process: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not metrics.exists() or len(metrics.read_text().splitlines()) < rows:
        assert process.poll() is None and time.monotonic() < deadline, "the run did not get that far"
        time.sleep(0.1)


def _wait_until_gone(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """Until no process of `process`'s process group (its session) is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "processes of the run are still running"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2])
def test_sigterm_stops_after_a_step_with_a_checkpoint_and_resumes_exactly(fly: Path, tmp_path: Path, cp: int):
    """SIGTERM to `genomelm train` (the one process; for cp=2 its whole process group, as Slurm or a container
    runtime sends it: the ranks and the forkserver ignore it, the launcher turns it into a request): every
    rank finishes its step, a checkpoint of that step is written, every process of the run exits, the command
    exits 143 (a run stopped early never exits 0) saying how to continue; the same command then continues with
    the losses of an uninterrupted run."""
    command = [sys.executable, "-m", "genomelm.cli", "train"]
    # lr constant after warm-up (min_lr_ratio=1): the schedule does not depend on the number of steps
    common = {"cp": cp, "min_lr_ratio": 1.0, "save_every": 1000, "warmup_steps": 1}
    reference = train(TrainConfig.load(None, settings(fly, tmp_path, run="whole", steps=6, **common)))[
        "losses"
    ]
    stopped_run = settings(fly, tmp_path, run="stopped", steps=1000, **common)
    process = subprocess.Popen(
        [*command, *stopped_run],
        cwd=ROOT,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    metrics = tmp_path / "runs" / "stopped" / "metrics.jsonl"
    try:
        _wait_for_rows(metrics, 2, process)
        (os.kill if cp == 1 else os.killpg)(process.pid, signal.SIGTERM)
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM, err
    step = int(out.split("stopped by SIGTERM after step ")[1].split()[0])
    assert 2 <= step < 6 and "resume=auto" in out
    assert [row["step"] for row in read_metrics(metrics)] == list(range(1, step + 1))
    assert Checkpointer(tmp_path / "runs" / "stopped").latest().name == f"step-{step:07d}"
    _wait_until_gone(process)  # no process of the run is left: ranks, forkserver, resource tracker
    resumed = train(TrainConfig.load(None, settings(fly, tmp_path, run="stopped", steps=6, **common)))
    assert resumed["start_step"] == step
    assert [row["loss"] for row in read_metrics(metrics)] == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2])
def test_second_signal_ends_the_run_at_once(fly: Path, tmp_path: Path, cp: int) -> None:
    """A second SIGTERM does not wait for the step: the one process ends where it is, the launcher kills its
    ranks; both exit 143 with one line saying how to continue; no process of the run is left."""
    command = [sys.executable, "-m", "genomelm.cli", "train"]
    run = settings(fly, tmp_path, cp=cp, steps=1000, save_every=1000)
    process = subprocess.Popen(
        [*command, *run],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_rows(tmp_path / "runs" / "r" / "metrics.jsonl", 1, process)
        os.kill(process.pid, signal.SIGTERM)
        # the second signal as soon as the first is the run's stop request: the step and checkpoint that
        # request waits for take far longer, so the second finds the run still inside them (sent after a
        # fixed pause instead, it could come after a fast stop had finished and the handlers were gone)
        request, deadline = tmp_path / "runs" / "r" / STOP_FILE, time.monotonic() + 60
        while not request.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr
            time.sleep(0.001)
        os.kill(process.pid, signal.SIGTERM)
        err = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("genomelm train: interrupted by SIGTERM: ended at once")
    assert "Traceback" not in err
    _wait_until_gone(process)


@pytest.mark.parametrize("name", ["step-0000004", ".tmp-step-0000004"])
def test_a_file_where_a_checkpoint_goes_is_refused_before_the_first_step(
    fly: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A file named like a checkpoint the run will write (or like its temporary folder) is found at the start,
    named, and refused (exit 2) before any step is trained, not when the step is saved."""
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / name).write_text("not a checkpoint")
    from genomelm.commands.train import main as train_main

    assert train_main(settings(fly, tmp_path, steps=4)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"genomelm train: {checkpoints / name} is a file where the run writes ")
    assert "move it out of" in line
    assert not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()
    assert (checkpoints / name).read_text() == "not a checkpoint"
