"""Fault injection for tests: one rank exits hard (no cleanup, like a lost node) after a chosen optimizer
step.

Off unless the environment variable `GENOMELM_FAULT` is `STEP:RANK` (e.g. `3:1`): rank RANK exits with status
17 right after optimizer step STEP, once per run folder (a marker file there lets a restarted run go on). The
local launcher hands each rank the caller's environment, and the Ray launcher forwards this variable to its
workers, so a test sets it around the launch.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "GENOMELM_FAULT"


def fault_setting() -> tuple[int, int] | None:
    """(step, rank) from `GENOMELM_FAULT`, or None when unset; a malformed value is an error naming the
    fix."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    step, _, rank = spec.partition(":")
    if not step.isdigit() or not (rank or "0").isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: give STEP:RANK, e.g. 3:1 (or unset it)")
    return int(step), int(rank or 0)


def inject_fault(run_dir: Path, step: int, rank: int) -> None:
    """Exit hard on the rank and step `GENOMELM_FAULT` names, the first time this run folder reaches it."""
    setting = fault_setting()
    if setting is None or setting != (step, rank):
        return
    marker = Path(run_dir) / f".fault-injected-step{step}-rank{rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    os._exit(17)
