"""One owner per run folder: `genomelm train` holds `runs/<run>/.lock` for as long as the run goes on.

The lock is a small JSON file (pid, host, start time, and every process of the run) created with O_EXCL
before anything of the run is written, by the process that launches the run (the one process, the local
launcher, or the Ray driver; the ranks it starts do not take it, but once they run the launcher adds them,
its forkserver and its resource tracker to the file: `add_processes`). A second run on the same folder is
refused with a message naming the holder. A lock none of whose processes runs on this host any more (a killed
run) is taken over with a warning; while the launcher is gone but one of its ranks still runs (a launcher
killed outright: its ranks stop at their next step, `genomelm.parallel.launcher_watch`) it is refused, naming
them. A process is known by its pid and start time, so a pid used again by another process is not the run's.
One held from
another host is never taken over, since this host cannot tell whether that process still runs, unless it was
taken in the same Slurm job (`SLURM_JOB_ID`): a requeued job runs again under its id, on other nodes, after
Slurm ended every process of the run before. A run folder the lock created is removed again when the run
wrote nothing into it (a run refused before it started).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import warnings
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import psutil

LOCK_FILE = ".lock"


class RunFolderUnwritable(ValueError):
    """The run folder (or a folder in it) cannot be written; the message names it and the fix."""


def check_writable(folder: Path) -> None:
    """Raise `RunFolderUnwritable` naming `folder` when a file cannot be made in it (os.access answers for
    the permission bits alone: a read-only mount, or root, needs a real try)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        unwritable(folder, exc)


def unwritable(folder: Path, exc: OSError) -> NoReturn:
    """Raise `RunFolderUnwritable` for `folder`, which refused a write with `exc`."""
    raise RunFolderUnwritable(
        f"the run folder {folder} cannot be written ({exc.strerror or type(exc).__name__}): make it "
        "writable, or give the run another place: runs_dir=<folder> or run=<name>"
    ) from exc


class RunLocked(RuntimeError):
    """The run folder belongs to another live run; the message names it and the way out."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


def process_entry(pid: int) -> list[float]:
    """[pid, start time] of a process (start time 0 where it cannot be read)."""
    try:
        return [pid, psutil.Process(pid).create_time()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return [pid, 0.0]


def _alive(pid: int, started: float = 0.0) -> bool:
    """Whether `pid` runs (not a zombie) and, when `started` is known, is the process that started then."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return not started or abs(process.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # a process of another user: it runs
        return True


def _nearest_folder(path: Path) -> Path:
    """`path`, or its nearest parent that exists (the one that refused the new folder)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _live_processes(holder: dict) -> list[int]:
    """The pids of the lock's processes that still run (its holder's own pid first, when it does)."""
    entries = [[holder.get("pid"), holder.get("pid_started", 0.0)], *holder.get("processes", [])]
    live = []
    for entry in entries:
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and entry[0] not in live:
            if _alive(entry[0], float(entry[1] or 0.0)):
                live.append(entry[0])
    return live


class RunLock:
    """`with RunLock(run_dir):` holds the run folder's lock for the block (see the module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}
        self.started = process_entry(os.getpid())[1]
        if os.environ.get("SLURM_JOB_ID"):  # a requeued job keeps its id, not its nodes
            self.owner["slurm_job"] = os.environ["SLURM_JOB_ID"]
        self.created_folder = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or take over a stale one; RunLocked when a live run holds it."""
        self.created_folder = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            unwritable(_nearest_folder(self.run_dir), exc)
        self.record = self.owner | {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "pid_started": self.started,
            "processes": [],
        }
        for _attempt in range(3):
            try:
                handle = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_clear()
                continue
            except OSError as exc:  # a read-only mount, a folder of another user
                unwritable(self.run_dir, exc)
            with os.fdopen(handle, "w") as out:
                json.dump(self.record, out)
            return
        raise RunLocked(f"could not take {self.path}: other processes keep taking it; is a run restarting?")

    def _refuse_or_clear(self) -> None:
        """RunLocked naming a live holder; remove the lock of a dead one (this host) with a warning."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError):
            holder = {}  # torn: a kill while it was written
        pid, host = holder.get("pid"), holder.get("host")
        job = self.owner.get("slurm_job")
        here = isinstance(pid, int) and host == self.owner["host"]
        live = _live_processes(holder) if here else []
        dead_here = here and not live
        if dead_here or (job is not None and holder.get("slurm_job") == job):
            why = "which no longer runs" if dead_here else f"an earlier run of Slurm job {job}, requeued"
            warnings.warn(
                f"{self.path}: taking over the lock of pid {pid} on {host} (started "
                f"{holder.get('started')}), {why}",
                stacklevel=3,
            )
            self.path.unlink(missing_ok=True)
            return
        if here and pid not in live:
            raise RunLocked(
                f"run folder {self.run_dir} is still in use by pid{'s' if len(live) > 1 else ''} "
                f"{', '.join(map(str, live))} of the run pid {pid} launched (lock {self.path}); that "
                "launcher is gone, and they stop at their next step: run again in a few seconds"
            )
        if not holder:
            raise RunLocked(
                f"{self.path} exists but cannot be read; if no run uses {self.run_dir}, remove the file and "
                "run again"
            )
        raise RunLocked(
            f"run folder {self.run_dir} is in use by pid {pid} on {host} since {holder.get('started')} "
            f"(lock {self.path}); wait for that run to end or stop it, or give this one another name: "
            "run=NAME"
        )

    def add_processes(self, pids: Iterable[int]) -> None:
        """Record `pids` (a launch's ranks and helpers) as processes of the run: the lock is taken over only
        once none of them runs. The file is replaced whole (a temporary name renamed over it)."""
        known = {entry[0] for entry in self.record["processes"]}
        self.record["processes"] += [process_entry(pid) for pid in pids if pid not in known]
        tmp = self.path.with_name(f"{LOCK_FILE}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.record))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk: the lock still names the launcher (enough while it runs)
            tmp.unlink(missing_ok=True)
            warnings.warn(f"{self.path}: could not record the run's processes ({exc.strerror})", stacklevel=2)

    def release(self) -> None:
        """Remove the lock if this process holds it, and the run folder if the lock created it and it is
        empty."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]:
            self.path.unlink(missing_ok=True)
            if self.created_folder and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()
