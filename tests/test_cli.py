"""How a command ends: one line and an exit status for every failure (2 the input, 1 the machine, 128 + N a
signal), the traceback only with --debug, warnings as one line, a rank's error naming its rank."""

from __future__ import annotations

import errno
import signal
import warnings
from pathlib import Path

import pytest

from genomelm.cli import main as cli_main
from genomelm.commands import train as command
from genomelm.data.errors import DataError, DiskFull
from genomelm.parallel.launch import Interrupted, LaunchError
from genomelm.run.failures import FAILURE_FILE, exit_code, one_line, report_failure
from genomelm.run.lock import RunLocked


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValueError("steps=-1: give steps >= 1"), 2),
        (FileNotFoundError("no run config at x.yaml"), 2),
        (DataError("train.bin: bytes 0-16 changed"), 2),
        (RunLocked("in use by pid 7"), 2),
        (DiskFull(errno.ENOSPC, "no space left on /dev/sda (/) writing x"), 1),
        (LaunchError("rank 1 of 2 exited with signal SIGKILL"), 1),
        (Interrupted(signal.SIGTERM), 143),
        (Interrupted(signal.SIGINT), 130),
        (KeyError("x"), 1),
    ],
)
def test_exit_status_of_each_kind_of_failure(error: Exception, code: int) -> None:
    assert exit_code(error) == code


def test_a_ranks_error_names_its_rank_and_an_unexpected_one_says_so() -> None:
    error = DataError("train.bin: bytes 0-16 changed; rebuild it: `genomelm data ... --force`")
    error.add_note("raised on rank 1 of 2 in _train_on_rank")
    assert one_line(error) == f"{error} (on rank 1 of 2)"
    assert one_line(KeyError("x")) == (
        "KeyError: 'x' (an internal error: run again with --debug for the traceback, and report it)"
    )
    assert one_line(DiskFull(errno.ENOSPC, "no space left on / writing x")) == "no space left on / writing x"


def test_an_unexpected_error_is_one_line_and_its_traceback_comes_with_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def broken(argv: list[str]) -> int:
        raise KeyError("layers.0.weight")

    monkeypatch.setattr(command, "main", broken)
    monkeypatch.setenv("GENOMELM_DEBUG", "0")  # --debug sets it to 1 for the ranks; restored after the test
    assert cli_main(["train", "model=tiny"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "genomelm train: KeyError: 'layers.0.weight' (an internal error: run again with --debug for the "
        "traceback, and report it)\n"
    )
    assert cli_main(["--debug", "train", "model=tiny"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("genomelm train: KeyError")


def test_warnings_are_one_line_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's default repeats the source line under the message; the command line prints the message."""
    monkeypatch.setattr(command, "main", lambda argv: 0)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    monkeypatch.delenv("GENOMELM_DEBUG", raising=False)
    assert cli_main(["train"]) == 0
    text = warnings.formatwarning("step-0000004 is damaged", UserWarning, "/x/loop.py", 262, "line 262")
    assert text == "genomelm: warning: step-0000004 is damaged\n"


def test_a_machines_failure_keeps_its_details_in_the_run_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("GENOMELM_DEBUG", raising=False)
    error = LaunchError("rank 1 of 2 stuck: rank 0 waited 30 s for it\n--- rank 1 ---\n  File x, in step")
    assert report_failure("genomelm train", error, tmp_path) == 1
    line = capsys.readouterr().err
    details = tmp_path / FAILURE_FILE
    assert line == (  # after a newline: a rank's progress bar may have been cut mid-line
        f"\ngenomelm train: rank 1 of 2 stuck: rank 0 waited 30 s for it; details: {details}\n"
    )
    assert "--- rank 1 ---" in (tmp_path / FAILURE_FILE).read_text()
    assert report_failure("genomelm train", ValueError("lr=-1"), tmp_path, hint="give lr >= 0") == 2
    assert capsys.readouterr().err == "genomelm train: lr=-1; give lr >= 0\n"


def test_a_collective_that_lost_its_peer_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun or srun a rank whose peer was killed sees gloo's (or NCCL's) error: one line naming this
    rank and what happened, the machine's exit status, no "internal error"."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    error = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4327: Connection reset by "
        "peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    line = one_line(error)
    assert line.startswith("rank 0 of 2 lost another rank of its group (killed, out of memory or crashed")
    assert "internal error" not in line and "Connection reset by peer" in line
    assert exit_code(error) == 1
