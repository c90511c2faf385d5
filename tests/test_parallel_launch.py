"""The local launcher: results in rank order, a rank's error re-raised in the parent, hangs, deaths and stuck
ranks turned into failures that name the rank, signals (gloo, 2 or 3 processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from genomelm.data.integrity import DamagedFolder
from genomelm.parallel import LaunchError, LaunchTimeout, is_output_rank, launch
from genomelm.parallel.launch import REAP_GRACE_S, STUCK_GRACE_S, Interrupted, StuckRank
from genomelm.parallel.launcher_watch import ORPHAN_GRACE_S

TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT_S = 5.0


class ShardMismatch(ValueError):
    """An error type the parent must see as such."""


def _report_rank(offset: int) -> tuple[int, int, str, bool, float, str, str]:
    total = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(total)
    return (
        dist.get_rank(),
        dist.get_world_size(),
        os.environ["LOCAL_RANK"],
        is_output_rank(),
        total.item(),
        os.environ["GENOMELM_LAUNCH_PROBE"],
        os.getcwd(),
    )


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ShardMismatch("rank 1 found a bad shard")
    dist.barrier()  # rank 0 waits here for a peer that never comes: the launcher must stop it


def _rank_0_waits_for_sleeping_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def _exit_without_reporting() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _rank_1_dies_in_a_collective(how: str) -> None:
    """Rank 1 dies while ranks 0 and 2 wait in an all_reduce for it (their connections to it already made)."""
    total = torch.ones(4)
    dist.all_reduce(total)
    if dist.get_rank() == 1:
        time.sleep(0.5)  # the others are inside the next all_reduce by now
        if how == "close first":  # its connections close well before the process ends
            dist.destroy_process_group()
            time.sleep(1.0)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.all_reduce(total)


def _rank_1_is_stuck() -> None:
    total = torch.ones(4)
    dist.all_reduce(total)
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(total)


def test_results_come_back_in_rank_order(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each rank sees its rank variables, the caller's environment and folder at the time of the launch."""
    monkeypatch.setenv("GENOMELM_LAUNCH_PROBE", "set by the caller")
    monkeypatch.chdir(tmp_path)
    caller = ("set by the caller", str(tmp_path))
    assert launch(_report_rank, 2, 10, timeout_s=TIMEOUT_S) == [
        (0, 2, "0", True, 21.0, *caller),
        (1, 2, "1", False, 21.0, *caller),
    ]


def test_a_ranks_error_is_re_raised_with_its_traceback_and_stops_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(ShardMismatch, match="rank 1 found a bad shard") as info:
        launch(_fail_on_rank_1, 2, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S / 2  # not by the timeout
    assert "raised on rank 1 of 2 in _fail_on_rank_1" in info.value.__notes__[0]
    cause = str(info.value.__cause__)
    assert "Traceback" in cause and "in _fail_on_rank_1" in cause and 'raise ShardMismatch("rank 1' in cause


def test_a_hang_becomes_a_failure_with_the_stuck_ranks_stacks() -> None:
    with pytest.raises(LaunchTimeout) as info:
        launch(_rank_0_waits_for_sleeping_rank_1, 2, timeout_s=6.0)
    message = str(info.value)
    assert "ranks [0, 1] of 2 still running after 6.0 s" in message
    rank0, rank1 = message.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in barrier" in rank0 and "_rank_0_waits_for_sleeping_rank_1" in rank0
    assert "_rank_0_waits_for_sleeping_rank_1" in rank1 and "in barrier" not in rank1  # asleep before it


def test_a_rank_that_dies_without_reporting_fails_the_launch() -> None:
    with pytest.raises(LaunchError, match="rank 1 of 2 exited with exit code 3 before reporting"):
        launch(_exit_without_reporting, 2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    ("how", "status"),
    [("exit", "exit code 3"), ("sigkill", "signal SIGKILL"), ("close first", "exit code 3")],
)
def test_a_rank_that_dies_in_a_collective_is_named(how: str, status: str) -> None:
    """Gloo fails the survivors' all_reduce at once ("Connection closed by peer"); the launch names the dead
    rank, not their errors, even when those come in before its death shows ("close first")."""
    start = time.monotonic()
    with pytest.raises(LaunchError, match=f"rank 1 of 3 exited with {status} before reporting") as info:
        launch(
            _rank_1_dies_in_a_collective,
            3,
            how,
            timeout_s=TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S + REAP_GRACE_S
    if how == "close first":
        assert "Connection closed by peer" in info.value.__notes__[0]


def test_a_rank_stuck_outside_a_collective_is_named_by_those_waiting_for_it() -> None:
    """Ranks 0 and 2 wait in an all_reduce for rank 1, which sleeps: after collective_timeout_s they raise
    gloo's timeout, and the launch names rank 1 (not them), what it is doing, and where they waited."""
    start = time.monotonic()
    with pytest.raises(StuckRank) as info:
        launch(_rank_1_is_stuck, 3, timeout_s=TIMEOUT_S, collective_timeout_s=3.0)
    assert time.monotonic() - start < 3.0 + STUCK_GRACE_S + REAP_GRACE_S
    line = str(info.value).splitlines()[0]
    assert line.startswith("rank 1 of 3 stuck: ranks 0, 2 waited 3 s for it in all_reduce"), line
    assert "rank 1 is sleeping outside the collective" in line
    assert "--- rank 1 ---" in str(info.value) and "in _rank_1_is_stuck" in str(info.value)  # its stack
    assert "Timed out waiting 3000ms" in str(info.value.__cause__)  # a waiting rank's own error


def _rank_1_stops_itself() -> None:
    total = torch.ones(4)
    dist.all_reduce(total)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(total)


def test_a_stopped_rank_is_named_with_its_state() -> None:
    with pytest.raises(StuckRank, match=r"rank 1 of 2 stuck: rank 0 waited 3 s .* stopped \(SIGSTOP"):
        launch(_rank_1_stops_itself, 2, timeout_s=TIMEOUT_S, collective_timeout_s=3.0)


def _raise_damaged_folder() -> None:
    if dist.get_rank() == 1:
        raise DamagedFolder(Path("/data/fly/train.bin"), "bytes 0-16 changed", "rebuild it: `genomelm data`")
    dist.barrier()


class _Unrebuildable(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{text} ({code})")


def _raise_unrebuildable() -> None:
    if dist.get_rank() == 1:
        raise _Unrebuildable(7, "no way back")
    dist.barrier()


def test_errors_keep_their_type_or_at_least_their_last_line() -> None:
    """A typed error with its own constructor arrives as that type; one that cannot be rebuilt arrives as a
    LaunchError naming the rank and holding the error's last line, never only a traceback."""
    with pytest.raises(DamagedFolder, match=r"train.bin: bytes 0-16 changed; rebuild it") as info:
        launch(_raise_damaged_folder, 2, timeout_s=TIMEOUT_S)
    assert info.value.path == Path("/data/fly/train.bin")
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised .*_Unrebuildable: no way back \(7\)\n"):
        launch(_raise_unrebuildable, 2, timeout_s=TIMEOUT_S)


def _sleep_long() -> None:
    time.sleep(600)


def _signal_this_process_in(seconds: float, signum: int = signal.SIGTERM) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signum))
    timer.start()
    return timer


def test_a_signal_ends_a_launch_at_once_and_a_callback_turns_the_first_into_a_request() -> None:
    """Without on_signal a SIGTERM kills the ranks (they ignore it themselves) and raises Interrupted (exit
    status 143); with it, the first signal only reaches the callback, a second one ends the launch."""
    start = time.monotonic()
    _signal_this_process_in(3.0)
    with pytest.raises(Interrupted, match="interrupted by SIGTERM") as info:
        launch(_sleep_long, 2, timeout_s=TIMEOUT_S)
    assert info.value.exit_code == 143 and time.monotonic() - start < TIMEOUT_S / 2
    asked: list[int] = []
    _signal_this_process_in(3.0, signal.SIGINT)
    _signal_this_process_in(6.0)
    with pytest.raises(Interrupted, match="interrupted by SIGTERM"):
        launch(_sleep_long, 2, timeout_s=TIMEOUT_S, on_signal=asked.append)
    assert asked == [signal.SIGINT]


_KILLED_LAUNCHER = """
import json, sys, time
from genomelm.parallel import launch
launch(time.sleep, 2, 600.0, on_started=lambda pids: print(json.dumps(pids), flush=True))
"""


def test_a_launcher_killed_outright_leaves_no_process_behind() -> None:
    """kill -9 of the launcher: its ranks (here in a sleep, far from any step boundary) see it gone and exit
    within ORPHAN_GRACE_S; the forkserver and the resource tracker follow once no rank holds their pipes."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _KILLED_LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids = json.loads(launcher.stdout.readline())
    assert len(pids) == 4  # two ranks, the forkserver, the resource tracker
    assert all(psutil.pid_exists(pid) for pid in pids)
    launcher.kill()
    launcher.wait()  # reaped at once here; the ranks also see an unreaped (zombie) launcher as gone
    give_up = time.monotonic() + ORPHAN_GRACE_S + 10.0
    while (alive := [pid for pid in pids if _runs(pid)]) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert not alive
    assert "its launcher (pid" in launcher.stderr.read()


def _runs(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
