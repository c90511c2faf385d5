"""Stopping a run on request: SIGTERM (what Kubernetes, Slurm and Ray send before they preempt) or SIGINT.

`StopRequest` turns the first signal into a request: the run finishes its current step, every rank agrees to
stop after the same step (`agreed`: one all-reduce of a flag per step), a complete checkpoint is written and
`train` returns normally. Without a launcher, a second signal ends the process at once; under the local
launcher the ranks only take requests (the launcher forwards SIGTERM to them and, on a second signal, kills
them, `genomelm.parallel.launch`). Ray workers get no signal from the driver: the driver writes the stop file
`runs/<run>/.stop` (`request_stop`), which every rank looks for after each step.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_FILE = ".stop"  # in the run folder: a launcher's request to stop after the current step


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask every rank of the run in `run_dir` to stop after its current step (a shared file system: Ray);
    `reason` (e.g. "SIGTERM") is what the run reports it stopped by."""
    (Path(run_dir) / STOP_FILE).write_text(reason)


def clear_stop(run_dir: Path) -> None:
    """Forget a stop request (at the start of a run, and once a stopped run has ended)."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


class StopRequest:
    """`with StopRequest(exit_on_second) as stop:` ... `stop.agreed(device)` after each step."""

    def __init__(self, exit_on_second: bool, run_dir: Path | None = None) -> None:
        self.exit_on_second = exit_on_second
        self.stop_file = Path(run_dir) / STOP_FILE if run_dir is not None else None
        self.received: str | None = None  # the first signal's name
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and self.exit_on_second:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the default action: end now
            return
        self.received = self.received or signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop, by a signal or the stop file (the same answer on every rank;
        one all-reduce under a launcher, on `device`)."""
        if self.received is None and self.stop_file is not None and self.stop_file.exists():
            self.received = self.stop_file.read_text().strip() or "a stop request"
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received is not None
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
