"""The local launcher: results in rank order, a rank's error re-raised in the parent, hangs and deaths turned
into failures (gloo, 2 or 3 processes)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from genomelm.parallel import LaunchError, LaunchTimeout, is_output_rank, launch
from genomelm.parallel.launch import DEATH_GRACE_S, STOP_GRACE_S

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
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S + STOP_GRACE_S
    if how == "close first":
        assert "Connection closed by peer" in info.value.__notes__[0]


def test_a_collective_waiting_for_a_stuck_rank_fails_after_collective_timeout_s() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 3000ms") as info:
        launch(_rank_1_is_stuck, 3, timeout_s=TIMEOUT_S, collective_timeout_s=3.0)
    assert time.monotonic() - start < 3.0 + DEATH_GRACE_S + STOP_GRACE_S
    assert "in _rank_1_is_stuck" in info.value.__notes__[0]
