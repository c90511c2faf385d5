"""A rank never outlives its launcher: `watch_launcher(pid, pipe_fd)` in every rank of a local launch, and in
every rank torchrun started (watching torchrun: `genomelm.run.env_launch`).

Once the launcher is gone (killed outright: SIGKILL, the OOM killer, a node agent), `launcher_lost()` turns
true; the training loop looks at its next step boundary (`check_launcher`) and stops there without saving,
and a rank still running ORPHAN_GRACE_S later (stuck in a collective with a rank that already stopped)
exits; a rank that stops at no step boundaries (scoring: nothing to save) exits at once. Nothing is written
over: a checkpoint cut short stays a `.tmp-` folder the next run removes, and the next run continues from
the newest complete checkpoint, dropping the metrics rows after it.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time

import psutil

ORPHAN_POLL_S = 0.2  # how often a rank looks for its launcher
ORPHAN_GRACE_S = 5.0  # how long a rank whose launcher is gone gets to reach a step boundary before it exits
EXIT_ORPHANED = 1  # the status of a rank that ended because its launcher was gone (nobody reads it)

# set by `watch_launcher`'s thread once this rank's launcher is gone: its pid
_lost_launcher: list[int] = []
# set once a loop looks at step boundaries (`check_launcher`): only such a rank waits for one
_stepping: list[bool] = []


class LauncherLost(RuntimeError):
    """This rank's launcher is gone: the rank stops without saving or reporting."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)

    def __init__(self, pid: int) -> None:
        self.pid = int(pid)
        super().__init__(f"the launcher (pid {self.pid}) is gone: this rank stops without saving")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.pid,))


def launcher_lost() -> bool:
    """Whether this process is a rank whose launcher is gone (`watch_launcher`)."""
    return bool(_lost_launcher)


def check_launcher() -> None:
    """Raise `LauncherLost` in a rank whose launcher is gone (at a step boundary: nothing is saved after)."""
    _stepping[:] = [True]
    if _lost_launcher:
        raise LauncherLost(_lost_launcher[0])


def watch_launcher(pid: int, pipe_fd: int | None = None, grace_s: float = ORPHAN_GRACE_S) -> threading.Thread:
    """Watch launcher `pid` from a daemon thread, every ORPHAN_POLL_S: once the pipe whose write end is
    `pipe_fd` has no reader (the launcher's fds close as it dies, before it is reaped) or `pid` is gone or a
    zombie, `launcher_lost()` turns true, one line goes to stderr, and the process exits (EXIT_ORPHANED): at
    once when nothing here stops at step boundaries (scoring: nothing to save), else after `grace_s` if it
    still runs. A thread rather than PR_SET_PDEATHSIG: a local rank's parent is the
    forkserver, which lives as long as its ranks do, and this works where prctl does not exist."""
    watched = os.dup(pipe_fd) if pipe_fd is not None else None  # the rank closes its own when it reports

    def watch() -> None:
        while not _hung_up(watched) and _process_alive(pid):
            time.sleep(ORPHAN_POLL_S)
        print(  # first: the rank may exit as soon as it knows
            f"\ngenomelm: rank {os.environ.get('RANK', '?')}: its launcher (pid {pid}) is gone; stopping "
            "without saving",
            file=sys.stderr,
            flush=True,
        )
        _lost_launcher.append(pid)
        if _stepping:  # a training loop: its next step boundary, or the grace's end
            time.sleep(grace_s)
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="watch-launcher", daemon=True)
    thread.start()
    return thread


def _hung_up(fd: int | None) -> bool:
    """Whether the pipe whose write end is `fd` has no reader left (poll's POLLERR or POLLHUP)."""
    if fd is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # errors and hang-ups are reported without asking
    return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: a killed launcher that its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
