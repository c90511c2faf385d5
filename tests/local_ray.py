"""One local Ray at a time on this machine, across pytest-xdist workers (`make test` runs one per core)."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def one_local_ray() -> Iterator[None]:
    """Held while a test runs a local Ray: two on one small machine would each claim every core, and the
    tests time Ray's start-up (a signal during it, restarts within a limit)."""
    with open(Path(tempfile.gettempdir()) / "genomelm-tests-local-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
