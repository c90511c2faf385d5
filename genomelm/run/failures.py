"""How a command ends when something fails: one line saying what and where, an exit status, and the details
(tracebacks, a rank's traceback, stuck ranks' stacks) kept in the run folder.

Exit statuses (docs/reliability.md):

| status | meaning |
|---|---|
| 0 | done |
| 1 | the machine or the program: disk full, a lost or stuck rank, an internal error |
| 2 | the user's input: a setting, a file, prepared data, a checkpoint, a run folder in use, a diverged run |
| 128 + N | stopped early by signal N (130: SIGINT, 143: SIGTERM), as shells and torchelastic report it |

An exception may say its own status with an `exit_code` attribute (as click's exceptions do); otherwise
`ValueError`s, missing files and `DataError`s are the user's input and everything else the machine's. A rank's
error arrives with a note naming its rank (`genomelm.parallel.launch`), which the line repeats. `--debug` on
the command line (or GENOMELM_DEBUG=1) prints the whole traceback as well.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from pathlib import Path

from genomelm.data.errors import DataError
from genomelm.parallel.launch import LaunchError

EXIT_MACHINE = 1
EXIT_INPUT = 2
DEBUG_ENV = "GENOMELM_DEBUG"
FAILURE_FILE = "failure.txt"  # in the run folder: the last failure's details
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, DataError)
_RANK_NOTE = re.compile(r"raised on (?:Ray Train worker )?rank (\d+)(?: of (\d+))?")
# a collective's error when a peer rank is gone (gloo: "Connection reset/closed by peer", a broken pipe;
# NCCL: "remote process exited", an aborted communicator)
LOST_PEER = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited|communicator was aborted",
    re.IGNORECASE,
)


def exit_code(exc: BaseException) -> int:
    """The exit status a command ends with after `exc` (see the module docstring)."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    return EXIT_INPUT if isinstance(exc, INPUT_ERRORS) else EXIT_MACHINE


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def is_expected(exc: BaseException) -> bool:
    """Whether `exc` is a failure the program reports as such (not a bug): it says its exit status, it is the
    user's input or the operating system's error, or a collective's error because a peer rank is gone."""
    return (
        isinstance(getattr(exc, "exit_code", None), int)
        or isinstance(exc, (*INPUT_ERRORS, OSError))
        or lost_peer(exc)
    )


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective's error because another rank of the group ended (killed, out of memory,
    crashed), as a rank of a torchrun or srun launch sees it."""
    return bool(LOST_PEER.search(str(exc)))


def one_line(exc: BaseException) -> str:
    """The first line of the error's message, the rank it came from, and for an unexpected one its type and
    what to do."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    if lost_peer(exc) and not isinstance(getattr(exc, "exit_code", None), int):
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        where = f"rank {rank} of {world}" if rank is not None and world else "this rank"
        text = (
            f"{where} lost another rank of its group (killed, out of memory or crashed: the launcher's "
            "report and that rank's log say which); the same command continues from the newest checkpoint "
            f"[{text[:160]}]"
        )
    for note in getattr(exc, "__notes__", ()):
        found = _RANK_NOTE.search(note)
        if found is not None:
            text += f" (on rank {found[1]}{f' of {found[2]}' if found[2] else ''})"
            break
    if not is_expected(exc):
        text = (
            f"{type(exc).__name__}: {text} (an internal error: run again with --debug for the traceback, and "
            "report it)"
        )
    return text


def details(exc: BaseException) -> str:
    """The whole story of `exc`: its message, notes, traceback and causes (a rank's traceback included)."""
    return "".join(traceback.format_exception(exc))


def report_failure(
    prog: str, exc: BaseException, run_dir: Path | None = None, hint: str | None = None
) -> int:
    """Print `prog: <one line>[; <hint>]` (and, with --debug, the traceback) on stderr; for a machine's
    failure also write its details to `run_dir/failure.txt` when a run folder exists. Returns the exit
    status."""
    code = exit_code(exc)
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    line = f"{prog}: {one_line(exc)}" + (f"; {hint}" if hint else "")
    if isinstance(exc, LaunchError):  # a rank ended or killed mid-line (its progress bar) leaves it open
        line = "\n" + line
    if run_dir is not None and code == EXIT_MACHINE and Path(run_dir).is_dir():
        written = write_details(Path(run_dir) / FAILURE_FILE, details(exc))
        if written is not None and (len(str(exc).strip().splitlines()) > 1 or not is_expected(exc)):
            line += f"; details: {written}"  # a stuck rank's stacks, an internal error's traceback
    print(line, file=sys.stderr, flush=True)
    return code


def one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """`warnings.formatwarning` for the command line: "genomelm: warning: <message>", without the source
    line Python's default repeats (set by `genomelm.cli` unless --debug; its ranks take it over)."""
    return f"genomelm: warning: {message}\n"


def write_details(path: Path, text: str) -> Path | None:
    """Write `text` to `path` through a temporary name; None when it cannot be written (a full disk)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a read-only folder refuses the removal too
            tmp.unlink(missing_ok=True)
        return None
    return path
