"""Stopping a run on request: SIGTERM (what Kubernetes, Slurm and Ray send before they preempt) or SIGINT.

One story for every launcher. The process that holds the run folder's lock (the one process, the local
launcher or the Ray driver) turns the first signal into a stop request, the file `runs/<run>/.stop` naming it
(`StopSignals`, entered before anything of the run starts). Every rank, however it was launched, looks for
that file before its first step and after each step (`StopCheck.agreed`: one all-reduce of a flag, so all
stop after the same step); ranks under the local launcher ignore the signals themselves
(`genomelm.parallel.launch`), so a signal to the whole process group acts once. A request before the first
step ends the run at once with nothing to save; a later one after the current step, with a checkpoint of it.
A run that stopped early exits with 128 + the signal's number (`stop_exit_code`: 143 after SIGTERM, 130 after
SIGINT), as shells and torchelastic report it.

A second signal ends the run at once (`Interrupted`, the same exit status): the one process raises it where
it is, the local launcher kills its ranks, the Ray driver shuts its workers down. The lock holder removes the
request file when it starts and when it ends; ranks never do, so a request made while they start is kept.

Under launcher=env (torchrun or srun started every rank) there is no process above the ranks: each rank takes
SIGTERM, SIGINT and SIGUSR1 itself (`RankStopSignals`; 138 after SIGUSR1) and the same all-reduce agrees.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from genomelm.parallel.launch import STOP_SIGNALS, Interrupted

STOP_FILE = ".stop"  # in the run folder: the lock holder's request to stop after the current step
# the requests this process's `StopSignals` recorded, by run folder (they hold if the file cannot be written)
_received_here: dict[Path, str] = {}


def stop_exit_code(reason: str) -> int:
    """The exit status of a run stopped by `reason` (a signal's name; 143, as SIGTERM, for any other)."""
    try:
        return 128 + signal.Signals[reason].value
    except KeyError:
        return 128 + signal.SIGTERM


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask every rank of the run in `run_dir` to stop after its current step; `reason` (e.g. "SIGTERM") is
    what the run reports it stopped by. On a full disk the file's name alone carries the request."""
    path = Path(run_dir) / STOP_FILE
    try:
        path.write_text(reason)
    except OSError:
        path.touch()


def clear_stop(run_dir: Path) -> None:
    """Forget a stop request (the lock holder, as a run starts and once it has ended)."""
    clear_stop_file(run_dir)
    _received_here.pop(Path(run_dir).resolve(), None)


def clear_stop_file(run_dir: Path) -> None:
    """Remove the request file an earlier run left, keeping a signal this process already received."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def stop_requested(run_dir: Path) -> str | None:
    """The reason of the stop request of the run in `run_dir`, or None."""
    if Path(run_dir).resolve() in _received_here:
        return _received_here[Path(run_dir).resolve()]
    path = Path(run_dir) / STOP_FILE
    try:
        return path.read_text().strip() or "a stop request"
    except FileNotFoundError:
        return None


class StopSignals:
    """`with StopSignals(run_dir) as signals:` in the lock holder, for the whole run: the first SIGTERM or
    SIGINT becomes the stop request (`request`), a second raises `Interrupted` where the main thread is.
    `install()` puts the handlers back after a library replaced them (Ray's `init` does, for SIGTERM)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        clear_stop(self.run_dir)  # a request an earlier, stopped or killed run left
        self.install()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        clear_stop(self.run_dir)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def request(self, signum: int) -> None:
        """Record the first signal as the run's stop request (what the local launcher calls on a signal)."""
        if self.received is None:
            self.received = signal.Signals(signum).name
            _received_here[self.run_dir.resolve()] = self.received
            request_stop(self.run_dir, self.received)

    def handle(self, signum: int) -> None:
        """A signal's effect: the first is the stop request, a second ends the run at once (`Interrupted`)."""
        if self.received is not None:
            raise Interrupted(signum)
        self.request(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.handle(signum)


class StopCheck:
    """`StopCheck(run_dir).agreed(device)` on every rank, before the first step and after each one."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.received: str | None = None  # what this rank saw

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank saw a stop request (the same answer on every rank; one all-reduce under a
        launcher, on `device`, of the signal's number, so a rank that did not see it reports the same
        signal and exits with the same status)."""
        if self.received is None:
            self.received = stop_requested(self.run_dir)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received is not None
        seen = 0 if self.received is None else stop_exit_code(self.received) - 128
        flag = torch.tensor([float(seen)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.received is None:  # another rank saw it first
            self.received = signal.Signals(int(flag.item())).name
            # this rank is stopping too: the launcher's signals after it (torchrun's SIGTERM once another rank
            # has exited) must not end it before its line and status (`RankStopSignals`)
            _received_here.setdefault(self.run_dir.resolve(), self.received)
        return bool(flag.item() > 0)


class RankStopSignals:
    """`with RankStopSignals(run_dir):` on every rank of a `launcher=env` run, from before its rendezvous to
    its end. There each rank gets the signal itself (torchrun forwards it to every worker, Slurm signals every
    task), so there is no lock holder to relay it: each SIGTERM, SIGINT or SIGUSR1 (what `sbatch
    --signal=USR1@<s>` sends before the time limit) records the run's stop request in this process, and
    `StopCheck`'s all-reduce tells the other ranks. A repeat is the same request (under Slurm a task gets one
    from Slurm and one from torchrun): the launcher owns the deadline (torchrun's --shutdown-timeout, Slurm's
    KillWait) and ends a rank that misses it with SIGKILL. After a stop or a failure the signals stay ignored:
    every rank then exits with the stop code (138 after SIGUSR1) or its failure's line, also one that torchrun
    signals once another rank has exited."""

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir).resolve()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> RankStopSignals:
        _received_here.pop(self.run_dir, None)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        ending = self.run_dir in _received_here or error is not None
        for sig, handler in self._previous.items():
            # a stopped or failed run ends with its line and its status: the launcher's next signal (torchrun
            # sends SIGTERM to the ranks still running once one has exited) must not cut that short
            signal.signal(sig, signal.SIG_IGN if ending else handler)
        _received_here.pop(self.run_dir, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        _received_here.setdefault(self.run_dir, signal.Signals(signum).name)
