"""`launcher=env`: each rank started by torchrun (`torchrun --nproc-per-node 2 -m genomelm train ...`) or
by srun (its variables set here over 2 processes: no Slurm needed) trains exactly as the local launcher; a
layout that does not match dp x cp is refused on every rank with one line; SIGTERM and SIGUSR1 stop the run
after a step with a checkpoint, and the same command continues it exactly."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_fixtures import fly_windows, step_losses, tiny_run

from genomelm.run.config import TrainConfig
from genomelm.run.env_launch import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    RankLayoutError,
    first_host,
    join_group,
    rank_layout,
    tasks_per_node,
)
from genomelm.run.stop import RankStopSignals, stop_exit_code, stop_requested

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 300  # per command; a 2-rank run of 8 steps of `tiny` takes ~20 s on 2 busy cores
STEPS = 8
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------------------ the rank layout
def test_torchrun_variables_give_the_layout_and_win_over_sruns() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    layout = rank_layout(env)
    assert (layout.rank, layout.world, layout.local_rank, layout.local_world) == (3, 8, 1, 2)
    assert (layout.master_addr, layout.master_port, layout.source) == ("node7", 29500, "torchrun")


def test_srun_variables_give_the_layout_with_the_first_host_and_a_port_from_the_job() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"}
    env |= {"SLURM_TASKS_PER_NODE": "2(x2),2", "SLURM_JOB_NODELIST": "gpu[007-009]", "SLURM_JOB_ID": "123456"}
    layout = rank_layout(env)
    assert (layout.rank, layout.world, layout.local_rank, layout.local_world) == (5, 6, 1, 2)
    assert layout.master_addr == "gpu007" and layout.source == "srun"
    assert layout.master_port == SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN
    chosen = rank_layout(env | {"MASTER_ADDR": "head", "MASTER_PORT": "2222"})
    assert (chosen.master_addr, chosen.master_port) == ("head", 2222)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[007-010,012],login1", "gpu007"),
        ("rack[2-3]-n[01-04]", "rack2-n01"),
        ("a[5,7]b", "a5b"),
    ],
)
def test_first_host_of_a_slurm_hostlist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_tasks_per_node_expands_slurms_repeats() -> None:
    assert tasks_per_node("8(x2),4") == [8, 8, 4]
    assert tasks_per_node("2") == [2]
    with pytest.raises(RankLayoutError, match="SLURM_TASKS_PER_NODE='8x2'"):
        tasks_per_node("8x2")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "no rank in the environment .*torchrun or srun, or use launcher=local"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK is set but not MASTER_ADDR, MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}, "no SLURM_JOB_ID"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK='x' is not a whole"),
    ],
)
def test_a_missing_or_bad_layout_says_what_to_set(env: dict[str, str], says: str) -> None:
    with pytest.raises(RankLayoutError, match=says):
        rank_layout(env)


def test_a_layout_that_does_not_match_the_mesh_is_refused_before_any_rendezvous(monkeypatch) -> None:
    for key, value in zip(RANK_VARIABLES, ("1", "2", "1", "2", "127.0.0.1", "1"), strict=True):
        monkeypatch.setenv(key, value)
    config = TrainConfig.from_args(["model=tiny", "dp=2", "cp=2"])
    with pytest.raises(RankLayoutError, match=r"torchrun started 2 ranks and the run's dp=2 x cp=2 needs 4"):
        join_group(config)


def test_each_stop_signal_is_the_one_request_on_a_rank(tmp_path: Path) -> None:
    handled = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    before = {sig: signal.getsignal(sig) for sig in handled}
    with RankStopSignals(tmp_path):
        assert stop_requested(tmp_path) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat (torchrun's copy) is the same request
        assert stop_requested(tmp_path) == "SIGUSR1"
        assert not (tmp_path / ".stop").exists()  # each rank got the signal itself: no file to relay it
    # stopped: the signals stay ignored until the process exits with its stop code
    assert stop_requested(tmp_path) is None
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in handled)
    for sig, handler in before.items():
        signal.signal(sig, handler)
    with RankStopSignals(tmp_path):
        pass
    assert all(signal.getsignal(sig) == before[sig] for sig in handled)  # nothing received: put back
    assert stop_exit_code("SIGUSR1") == 138 and stop_exit_code("SIGTERM") == 143


# ------------------------------------------------------------------------------ the Slurm example
def test_the_slurm_example_parses_comments_its_site_values_and_starts_the_run_configs_ranks() -> None:
    script = ROOT / "configs" / "cluster" / "b200x64.sbatch"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
    options = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    uncommented = [line for line in options if "#" not in line[1:] and "--job-name" not in line]
    assert not uncommented, uncommented  # each value says why it is what it is, or that it is the site's
    text = script.read_text()
    nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
    per_node = int(re.search(r"--nproc-per-node (\d+)", text).group(1))
    config = TrainConfig.load(
        [ROOT / "configs/train/hg38-1m.yaml", ROOT / "configs/cluster/b200x64-env.yaml"]
    )
    assert config.parallel.launcher == "env" and config.parallel.world == nodes * per_node
    assert (config.plan.gpus, config.plan.gpus_per_node) == (nodes * per_node, per_node)
    assert "--signals-to-handle SIGTERM,SIGINT,SIGUSR1" in text and "scontrol requeue" in text
    lead = int(re.search(r"--signal=B:USR1@(\d+)", text).group(1))
    assert lead > int(re.search(r"--shutdown-timeout (\d+)", text).group(1))  # time left to requeue


# ---------------------------------------------------------------------------- 2 ranks on this machine
@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("env") / "fly", "1-4096", 256)


def run_settings(data: Path, runs: Path, run: str, *extra: str) -> list[str]:
    """A run of `tiny` at cp=2 on 256-token windows, saving only at its last step."""
    settings = tiny_run(data, runs, seq=256, run=run, steps=STEPS, save_every=100, lr=3e-3, cp=2)
    return [*settings, *extra]


@pytest.fixture(scope="module")
def local_runs(fly: Path, tmp_path_factory) -> Path:
    """The runs folder of the same run on the local launcher, uninterrupted (run "local")."""
    from genomelm.commands.train import main as train_main

    runs = tmp_path_factory.mktemp("local-runs")
    assert train_main(run_settings(fly, runs, "local")) == 0
    return runs


@pytest.fixture(scope="module")
def local_losses(local_runs: Path) -> dict[int, float]:
    """Per-step losses of the local launcher's run."""
    return step_losses(local_runs, "local")


def clean_environment() -> dict[str, str]:
    """This process's environment without a rank layout (a test under another launcher may have one)."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and not k.startswith("SLURM_")}


def torchrun(settings: list[str], logs: Path, *flags: str, stage: str = "train") -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 -m genomelm <stage> ... launcher=env` in its own session, each rank's
    stdout and stderr in a file under `logs`."""
    # --standalone: a rendezvous on a free port (another test may run torchrun meanwhile)
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects"]
    command += ["3", *flags, "-m", "genomelm", stage, *settings, "launcher=env"]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"the command ran past {TIMEOUT_S} s:\n{out[-4000:]}")
    return process.returncode, out


def rank_output(logs: Path, rank: int, stream: str) -> str:
    """What rank `rank` wrote to `stream` ("stdout" or "stderr") in torchrun's newest attempt."""
    (path,) = sorted(logs.glob(f"*/attempt_*/{rank}/{stream}.log"))[-1:]
    return path.read_text()


def last_line(text: str) -> str:
    lines = [line.split("\r")[-1].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("train ")][-1]


def wait_for_a_step(runs: Path, run: str, processes: list[subprocess.Popen]) -> None:
    metrics = runs / run / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().strip()):
        assert all(p.poll() is None for p in processes), "the run ended before its first step was logged"
        assert time.monotonic() < deadline, "no step in time"
        time.sleep(0.1)


@pytest.mark.slow
def test_torchrun_trains_as_the_local_launcher(fly: Path, local_losses, tmp_path: Path) -> None:
    """Planned for 2 GPUs first (gpus=2), as a run on a cluster is: rank 0 plans before the rendezvous (the
    planner traces on a fake group of its own)."""
    code, out = finish(torchrun(run_settings(fly, tmp_path, "r", "gpus=2"), tmp_path / "logs"))
    assert code == 0, out[-4000:]
    assert step_losses(tmp_path, "r") == local_losses
    assert last_line(rank_output(tmp_path / "logs", 0, "stdout")).startswith("trained r: steps 0..8")
    assert rank_output(tmp_path / "logs", 1, "stdout") == ""  # rank 0 alone prints
    assert not (tmp_path / "r" / ".lock").exists()


@pytest.mark.slow
def test_eval_under_torchrun_writes_what_the_local_launcher_writes(
    fly: Path, local_runs: Path, tmp_path: Path
) -> None:
    """The scoring commands run on the group torchrun started: rank 0 writes the results, once."""
    from genomelm.commands.eval import main as eval_main

    settings = [*run_settings(fly, local_runs, "local"), "bucket=128"]
    assert eval_main([*settings, f"results_dir={tmp_path / 'local'}"]) == 0
    planned = [*settings, f"results_dir={tmp_path / 'env'}", "gpus=2"]  # planned first, before the rendezvous
    process = torchrun(planned, tmp_path / "logs", stage="eval")
    code, out = finish(process)
    assert code == 0, out[-4000:]
    written = [(tmp_path / where / "local" / "buckets.csv").read_bytes() for where in ("local", "env")]
    assert written[0] == written[1]
    assert rank_output(tmp_path / "logs", 1, "stdout") == ""
    assert "wrote " in rank_output(tmp_path / "logs", 0, "stdout")


def test_a_plan_that_does_not_fit_is_refused_on_every_rank(fly: Path, tmp_path: Path) -> None:
    """Rank 0 plans before the rendezvous; its refusal is every rank's one line, and nothing is written."""
    settings = run_settings(fly, tmp_path, "r", "gpus=2", "gpu_gib=0.001")
    code, out = finish(torchrun(settings, tmp_path / "logs"))
    assert code != 0
    for rank in (0, 1):
        lines = rank_output(tmp_path / "logs", rank, "stderr").strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("genomelm train: "), lines
        assert "does not fit" in lines[0], lines
    assert not (tmp_path / "r").exists()


def test_a_layout_that_does_not_match_is_refused_on_every_rank(fly: Path, tmp_path: Path) -> None:
    """Each of the 2 ranks srun would start refuses dp=2 x cp=2 with one line (exit 2) before any rendezvous,
    and nothing is written. (Under torchrun the first rank to exit makes torchrun stop the other, which may
    not have got as far: the ranks are started here as srun starts them, each on its own.)"""
    tasks = srun_tasks(run_settings(fly, tmp_path, "r", "dp=2"), free_slurm_port())
    for code, out, err in finish_tasks(tasks):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (code, lines)
        assert lines[0].startswith("genomelm train: launcher=env: srun started 2 ranks and the run's ")
        assert "dp=2 x cp=2 needs 4" in lines[0] and out == ""
    assert not (tmp_path / "r").exists()  # nothing of the run written


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_torchrun_group_stops_after_a_step_and_the_run_continues_exactly(
    signum: signal.Signals, fly: Path, local_losses, tmp_path: Path
) -> None:
    """torchrun forwards the signals it is told to handle to every rank (SIGUSR1, Slurm's warning before the
    time limit, is not among its defaults); the ranks agree on the step, rank 0 saves it and says so."""
    settings = run_settings(fly, tmp_path, "r")
    process = torchrun(settings, tmp_path / "logs", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    wait_for_a_step(tmp_path, "r", [process])
    os.killpg(process.pid, signum)
    code, out = finish(process)
    assert code != 0, out[-4000:]  # torchrun reports the signal it got
    said = last_line(rank_output(tmp_path / "logs", 0, "stdout"))
    assert said.startswith(f"stopped by {signum.name} after step "), said
    stopped = int(said.split("after step ")[1].split()[0])
    assert stopped < STEPS and (tmp_path / "r" / "checkpoints" / f"step-{stopped:07d}").is_dir()
    assert "Traceback" not in rank_output(tmp_path / "logs", 0, "stderr")
    code, out = finish(torchrun(settings, tmp_path / "logs-again"))
    assert code == 0, out[-4000:]
    assert step_losses(tmp_path, "r") == local_losses


def srun_tasks(settings: list[str], port: int) -> list[subprocess.Popen]:
    """The 2 tasks `srun --ntasks=2 genomelm train ... launcher=env` starts on one node, with the variables
    srun sets (the rendezvous port comes from the job id)."""
    env = clean_environment() | {
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": str(port - SLURM_PORT_BASE),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", "genomelm.cli", "train", *settings, "launcher=env"],
            cwd=ROOT,
            env=env | {"SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for task in range(2)
    ]


def free_slurm_port() -> int:
    """A free port that a job id maps to (SLURM_PORT_BASE .. + SLURM_PORT_SPAN)."""
    for _ in range(100):
        port = SLURM_PORT_BASE + random.randrange(SLURM_PORT_SPAN)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for the rendezvous")


def finish_tasks(tasks: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    done = []
    for task in tasks:
        try:
            out, err = task.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in tasks:
                other.kill()
            pytest.fail(f"a task ran past {TIMEOUT_S} s")
        done.append((task.returncode, out, err))
    return done


@pytest.mark.slow
def test_srun_tasks_stop_on_sigterm_with_a_checkpoint_and_continue_exactly(
    fly: Path, local_losses, tmp_path: Path
) -> None:
    """Slurm signals every task of the step (preemption, scancel, the time limit): each rank gets SIGTERM."""
    settings = run_settings(fly, tmp_path, "r")
    tasks = srun_tasks(settings, free_slurm_port())
    wait_for_a_step(tmp_path, "r", tasks)
    for task in tasks:
        os.kill(task.pid, signal.SIGTERM)
    (code0, out0, err0), (code1, out1, err1) = finish_tasks(tasks)
    assert (code0, code1) == (143, 143), err0[-3000:] + err1[-3000:]
    assert last_line(out0).startswith("stopped by SIGTERM after step ") and out1 == ""
    assert "Traceback" not in err0 + err1
    results = finish_tasks(srun_tasks(settings, free_slurm_port()))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert step_losses(tmp_path, "r") == local_losses
