"""Readers' holds on a run's checkpoints: `genomelm eval` (and the other scoring commands) on a run that still
trains holds the checkpoint it scores, and the run's pruning (`Checkpointer.prune`) leaves a held one.

A hold is a file `checkpoints/.holds/<step folder>.<host>.<pid>` naming the reading process (`hold`, removed
when that process exits). It counts while that process runs (`held`: the same pid and start time, not a
zombie); one a kill left names a process that no longer runs and counts no more. A hold taken on another host
always counts, since this host cannot tell whether its process runs: remove a stale one by hand.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from pathlib import Path

import psutil

HOLDS_DIR = ".holds"  # in the checkpoints folder


def hold(step_dir: Path) -> Path:
    """Hold the checkpoint `step_dir` for the life of this process; returns the hold's file."""
    step_dir = Path(step_dir)
    folder = step_dir.parent / HOLDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    host, pid = socket.gethostname(), os.getpid()
    path = folder / f"{step_dir.name}.{host}.{pid}"
    path.write_text(json.dumps({"pid": pid, "host": host, "started": psutil.Process(pid).create_time()}))
    atexit.register(path.unlink, missing_ok=True)
    return path


def held(step_dir: Path) -> bool:
    """Whether a reader holds the checkpoint `step_dir`."""
    step_dir = Path(step_dir)
    folder = step_dir.parent / HOLDS_DIR
    return folder.is_dir() and any(_counts(path) for path in folder.glob(f"{step_dir.name}.*"))


def _counts(path: Path) -> bool:
    """Whether the hold file `path` names a process that runs (or is one of another host's)."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # being written
    if record.get("host") != socket.gethostname():
        return True
    try:
        process = psutil.Process(int(record["pid"]))
        return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - record["started"]) < 1
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
    except psutil.AccessDenied:
        return True
