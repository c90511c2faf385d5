"""Run a function on N processes of this machine, one rank each, torchrun style.

`launch(fn, world_size, *args, device="cpu", timeout_s=..., collective_timeout_s=...)` starts `world_size`
processes, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment and the default process group initialised (gloo on the CPU, each rank with its share of the cores;
NCCL with one GPU per rank on CUDA), calls `fn(*args)` there and returns the ranks' return values in rank
order (`fn`, its arguments and its results must pickle). Rank 0 is the rank that writes outputs
(`is_output_rank`). The processes fork from a multiprocessing forkserver that has imported torch, and what
the ranks import next, once (`genomelm.parallel.rank_preload`; it never runs torch, so no threads or CUDA
state are inherited); like spawn, they get nothing from the caller but what is pickled, its sys.path, and
(set first thing in each rank) its environment variables, working directory and warning format.

Failures end the whole launch instead of hanging it:
- a rank raises: the other ranks are stopped and the parent re-raises that exception (same type and message,
  with a note naming the rank and the rank's traceback as its cause);
- a rank dies without reporting (a signal, os._exit): `LaunchError` naming it and its exit code or signal,
  also when the others' collectives fail first because of it (gloo raises "Connection closed by peer" at once
  on a peer that dies, or times out after `collective_timeout_s` where it had no connection to it yet);
- a collective that waits `collective_timeout_s` for a stuck peer: the waiting ranks raise (torch's timeout
  error), and `StuckRank` names the ranks they waited for: those that neither reported nor died within
  STUCK_GRACE_S of the first timeout, with their process state (stopped by SIGSTOP, busy, in I/O) and the
  collective and caller the waiting rank was in (from its traceback);
- ranks still running after `timeout_s`: each dumps the Python stacks of all its threads (faulthandler on
  SIGUSR1), all are stopped, and `LaunchTimeout` carries the stacks in its message.

A rank never outlives its launcher: the ranks are the forkserver's children, not the launcher's, and the
forkserver and the resource tracker live as long as the ranks do, so a launcher killed outright would leave
them all running. Each rank watches the launcher from a thread (`genomelm.parallel.launcher_watch`): once it
is gone, training stops at its next step boundary without saving, scoring at once, and none reports; the
forkserver dies with the launcher (`rank_signals`). `on_started(pids)` gives the caller every process of the
launch (ranks, forkserver, resource tracker), which the run folder's lock records (`genomelm.run.lock`).

Signals: the ranks and the forkserver they fork from ignore SIGINT and SIGTERM (`rank_signals`), so a signal
to the whole process group acts once, through the launching process. There, while the launch runs (start-up
included), the first SIGTERM or SIGINT goes to `on_signal` (the caller turns it into a request its ranks act
on, `genomelm.run.stop`) and the launch goes on collecting their reports; without `on_signal`, or on a
second signal, the ranks are killed and `Interrupted` is raised.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import re
import signal
import socket
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from genomelm.parallel.launcher_watch import EXIT_ORPHANED, launcher_lost, watch_launcher

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RANK_SIGNALS_MODULE = "genomelm.parallel.rank_signals"  # named, never imported here: its import ignores them
RANK_PRELOAD_MODULE = "genomelm.parallel.rank_preload"  # named, never imported here: what the ranks import
REAP_GRACE_S = 5.0  # how long a rank that reported gets to exit before SIGKILL
STACK_DUMP_WAIT_S = 5.0  # how long the ranks get to write their stacks after SIGUSR1
COLLECTIVE_TIMEOUT_MARGIN_S = 60.0  # no collective_timeout_s: the group's timeout is the launch's + this
DEATH_GRACE_S = 2.0  # how long a rank's error waits for another rank's death to show (it may follow from it)
STUCK_GRACE_S = 5.0  # after a collective timed out: how long the other ranks get to report before named stuck
# a rank's error that is a collective's timeout (gloo: "Timed out waiting 30000ms ..."; NCCL's watchdog:
# "... collective operation timeout ...")
TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)
FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
PROCESS_STATES = {  # /proc/<pid>/stat's state letter, as the report says it
    "T": "is stopped (SIGSTOP or job control)",
    "t": "is stopped by a debugger",
    "D": "is in uninterruptible I/O (a disk or network file system)",
    "R": "is running, outside the collective",
    "S": "is sleeping outside the collective (a lock, a sleep, I/O)",
    "Z": "has exited",
}


class LaunchError(RuntimeError):
    """A launch that failed other than by a rank's own exception."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


class LaunchTimeout(LaunchError):
    """Ranks still running when the launch timed out; the message holds their Python stacks."""


class StuckRank(LaunchError):
    """Ranks that the others waited for in a collective until it timed out; the message names them."""


class Interrupted(LaunchError):
    """A signal that ended the launch at once (the ranks were killed): the exit status is 128 + its number."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}: ended at once, without saving")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum,))


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank (the `__cause__` of the exception re-raised here)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def is_output_rank() -> bool:
    """Whether this process writes outputs (checkpoints, metrics, files): rank 0, or a process without a
    group."""
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    reader: Connection
    stack_path: Path


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    on_signal: Callable[[int], None] | None = None,
    on_started: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks ("cpu": gloo; "cuda": NCCL, rank r on GPU r) and return the
    results in rank order. `timeout_s`: the whole launch's limit (start-up included); None waits forever.
    `collective_timeout_s`: the process group's timeout; None: `timeout_s` plus COLLECTIVE_TIMEOUT_MARGIN_S
    (a hang is then reported by the launch timeout, with the stacks), or torch's default without one.
    `on_signal(signum)`: what the first SIGTERM or SIGINT to this process does (see the module docstring).
    `on_started(pids)`: called once every rank runs, with the pids of the ranks, the forkserver and the
    resource tracker."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if collective_timeout_s is None and timeout_s is not None:
        collective_timeout_s = timeout_s + COLLECTIVE_TIMEOUT_MARGIN_S
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise LaunchError(
            f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}"
        )
    context = multiprocessing.get_context("forkserver")
    # the server ignores SIGINT and SIGTERM, then imports torch once, with what every training or scoring
    # rank imports next (`genomelm.parallel.rank_preload`); each rank forks from it
    context.set_forkserver_preload([RANK_SIGNALS_MODULE, __name__, RANK_PRELOAD_MODULE])
    port = _free_port()
    caller = (dict(os.environ), os.getcwd(), warnings.formatwarning, os.getpid())
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="genomelm-launch-") as folder:
        with _signals_during_launch(ranks, on_signal) as starting:
            try:
                _start_forkserver()
                for rank in range(world_size):
                    reader, writer = context.Pipe(duplex=False)
                    stack_path = Path(folder) / f"stacks-rank{rank}.txt"
                    process = context.Process(
                        target=_run_rank,
                        args=(
                            fn,
                            args,
                            rank,
                            world_size,
                            port,
                            device,
                            collective_timeout_s,
                            str(stack_path),
                            writer,
                            caller,
                        ),
                        name=f"{_name(fn)}-rank{rank}",
                    )
                    process.start()
                    writer.close()  # the child holds the only write end: its exit closes the pipe
                    ranks.append(_Rank(rank, process, reader, stack_path))
                starting.done()
                if on_started is not None:
                    on_started([r.process.pid for r in ranks] + _helper_pids())
                results = _collect(ranks, fn, timeout_s, collective_timeout_s)
            except BaseException:
                _kill([r.process for r in ranks])
                raise
            _reap([r.process for r in ranks])
    return results


def _start_forkserver() -> None:
    """Start the forkserver (once per process) with SIGINT and SIGTERM blocked in this thread: the server
    inherits the mask and sets both to SIG_IGN before unblocking them (`rank_signals`); here a signal that
    came meanwhile is handled once they are unblocked. The resource tracker is started first: it blocks and
    then unblocks the same signals itself, which would unblock them for the server too."""
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _helper_pids() -> list[int]:
    """The pids of this process's forkserver and resource tracker (multiprocessing keeps them in private
    attributes: no public call names them)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    pids = [getattr(server, "_forkserver_pid", None), getattr(tracker, "_pid", None)]
    return [pid for pid in pids if isinstance(pid, int)]


class _StartUp:
    """Whether the ranks are still being started (a signal then waits until they all are: killing them half
    way could leave one the launch does not know of)."""

    def __init__(self) -> None:
        self.starting = True
        self.deferred: int | None = None

    def done(self) -> None:
        self.starting = False
        if self.deferred is not None:
            raise Interrupted(self.deferred)


@contextmanager
def _signals_during_launch(ranks: list[_Rank], on_signal: Callable[[int], None] | None) -> Iterator[_StartUp]:
    """While the launch runs (start-up included): the first SIGTERM or SIGINT goes to `on_signal`; without
    it, or on a second signal, the ranks are killed and `Interrupted` raised (after start-up if during
    it)."""
    start_up = _StartUp()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield start_up
        return
    received: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if on_signal is not None and len(received) == 1:
            on_signal(signum)
            return
        if start_up.starting:
            start_up.deferred = start_up.deferred or signum
            return
        _kill([r.process for r in ranks])
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield start_up
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _collect(
    ranks: Sequence[_Rank],
    fn: Callable[..., Any],
    timeout_s: float | None,
    collective_timeout_s: float | None,
) -> list[Any]:
    """Wait for every rank's report; raise the first failure (see the module docstring)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {r.rank: r for r in ranks}
    results: dict[int, Any] = {}
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise LaunchTimeout(_stuck_report(list(pending.values()), len(ranks), fn, timeout_s))
        ready = wait(_handles(pending.values()), remaining)
        for r in list(pending.values()):
            report = _take_report(r, ready)
            if report is None:
                continue
            del pending[r.rank]
            if report[0] == "died":
                raise _death(r, len(ranks), fn)
            if report[0] == "error":
                raise _failure(r, report, pending, len(ranks), fn, collective_timeout_s)
            results[r.rank] = report[1]
    return [results[rank] for rank in range(len(ranks))]


def _failure(
    r: _Rank,
    report: tuple[Any, ...],
    pending: dict[int, _Rank],
    world_size: int,
    fn: Callable[..., Any],
    collective_timeout_s: float | None,
) -> BaseException:
    """What rank r's error means for the launch. A rank's collective fails when a peer dies (gloo: "Connection
    closed by peer"), and its report can come in before the death shows: the dead rank is the one to name. A
    collective's timeout names the ranks that were waited for. Otherwise the rank's own exception."""
    timed_out = bool(TIMEOUT_TEXT.search(_last_line(report[2])))
    others = _settle(list(pending.values()), STUCK_GRACE_S if timed_out else DEATH_GRACE_S)
    dead = [pending[rank] for rank, other in others.items() if other[0] == "died"]
    if dead:
        error = _death(dead[0], world_size, fn)
        error.add_note(f"rank {r.rank} then raised {_last_line(report[2])}")
        return error
    if timed_out:
        stuck = [pending[rank] for rank in sorted(set(pending) - set(others))]
        if stuck:
            waiting = sorted([r.rank] + [rank for rank, other in others.items() if other[0] == "error"])
            error = StuckRank(_stuck_message(stuck, waiting, report[2], world_size, collective_timeout_s))
            error.__cause__ = RemoteTraceback(report[2])
            return error
    return _rank_exception(report[1], report[2], r.rank, world_size, fn)


def _settle(ranks: Sequence[_Rank], grace_s: float) -> dict[int, tuple[Any, ...]]:
    """The reports (("died",) for a rank that exited without one) that `ranks` give within `grace_s`; a rank
    still running then has no entry."""
    give_up = time.monotonic() + grace_s
    waiting = list(ranks)
    found: dict[int, tuple[Any, ...]] = {}
    while waiting and (remaining := give_up - time.monotonic()) > 0:
        ready = wait(_handles(waiting), remaining)
        for r in list(waiting):
            report = _take_report(r, ready)
            if report is not None:
                found[r.rank] = report
                waiting.remove(r)
    return found


def _stuck_message(
    stuck: Sequence[_Rank],
    waiting: Sequence[int],
    trace: str,
    world_size: int,
    collective_timeout_s: float | None,
) -> str:
    """One line naming the stuck ranks, what each one's process is doing, and where the first waiting rank
    waited; their Python stacks follow on later lines where they could be read."""
    names = ", ".join(str(r.rank) for r in stuck)
    states = "; ".join(f"rank {r.rank} {_process_state(r.process.pid)}" for r in stuck)
    where = _collective_of(trace)
    waited = f"{collective_timeout_s:g} s" if collective_timeout_s is not None else "its timeout"
    plural = "s" if len(stuck) > 1 else ""
    waiters = ", ".join(map(str, waiting))
    line = (
        f"rank{plural} {names} of {world_size} stuck: rank{'s' if len(waiting) > 1 else ''} {waiters} waited "
        f"{waited} for {'them' if plural else 'it'}{where} (collective_timeout_s); {states}"
    )
    stacks = _dump_stacks([r for r in stuck if _process_state_letter(r.process.pid) not in ("T", "t")])
    return "\n".join([line, *stacks])


def _collective_of(trace: str) -> str:
    """Where a waiting rank waited, from its traceback, as " in all_reduce (called from <file>:<line> in
    <function>)": its innermost torch.distributed call and the genomelm code that made it ("" if neither)."""
    frames = [m.groupdict() for m in FRAME.finditer(trace)]
    collective = [
        f["function"] for f in frames if "torch/distributed/" in f["file"] and f["function"] != "wrapper"
    ]
    ours = [
        f for f in frames if "/genomelm/" in f["file"] and "/genomelm/parallel/launch.py" not in f["file"]
    ]
    text = f" in {collective[-1]}" if collective else ""
    if ours:
        origin = ours[-1]
        short = origin["file"][origin["file"].rindex("/genomelm/") + 1 :]
        text += f" (called from {short}:{origin['line']} in {origin['function']})"
    return text


def _process_state_letter(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("R", "S", "T", ...); "" where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :][:1]


def _process_state(pid: int) -> str:
    letter = _process_state_letter(pid)
    return PROCESS_STATES.get(letter, f"is in process state {letter!r}" if letter else "cannot be inspected")


def _dump_stacks(ranks: Sequence[_Rank]) -> list[str]:
    """The Python stacks of `ranks` (faulthandler on SIGUSR1), as lines "--- rank r ---" and the stack."""
    for r in ranks:
        if r.process.is_alive():
            os.kill(r.process.pid, signal.SIGUSR1)
    give_up = time.monotonic() + STACK_DUMP_WAIT_S
    while ranks and time.monotonic() < give_up and not all(_stack_text(r) for r in ranks):
        time.sleep(0.05)
    time.sleep(0.1 if ranks else 0)  # let the last dump finish writing
    out = []
    for r in ranks:
        text = _stack_text(r) or "(no stack: the rank had not started its function yet, or had exited)"
        out.append(f"--- rank {r.rank} ---\n{text.rstrip()}")
    return out


def _last_line(trace: str) -> str:
    lines = trace.strip().splitlines()
    return lines[-1] if lines else ""


def _handles(ranks: Iterable[_Rank]) -> list[Any]:
    """What `wait` watches for each rank: its report pipe and its process's exit."""
    return [handle for r in ranks for handle in (r.reader, r.process.sentinel)]


def _take_report(r: _Rank, ready: Sequence[Any]) -> tuple[Any, ...] | None:
    """Rank r's report once `wait` returned `ready`: the report (see `_receive`), ("died",) when the rank
    exited without one, None while it is still running."""
    exited = r.process.sentinel in ready
    if r.reader not in ready and not exited:
        return None
    report = _receive(r.reader, wait_s=1.0 if exited else 0.0)
    return ("died",) if report is None and exited else report


def _death(r: _Rank, world_size: int, fn: Callable[..., Any]) -> LaunchError:
    """The failure of a rank that exited without reporting, with its exit code or signal."""
    r.process.join(REAP_GRACE_S)  # its pipe can close just before the process is reaped
    return LaunchError(
        f"{_name(fn)}: rank {r.rank} of {world_size} exited with {_describe_exit(r.process.exitcode)} before "
        "reporting (killed, out of memory or crashed; its output, if any, is above)"
    )


def _receive(reader: Connection, wait_s: float) -> tuple[Any, ...] | None:
    """A rank's report: ("ok", value), ("error", pickled exception or None, traceback text), ("died",) when
    the pipe closed without one, or None when nothing has arrived."""
    if not reader.poll(wait_s):
        return None
    try:
        return pickle.loads(reader.recv_bytes())
    except EOFError:
        return ("died",)


def _rank_exception(
    pickled: bytes | None, trace: str, rank: int, world_size: int, fn: Callable[..., Any]
) -> BaseException:
    """The rank's exception rebuilt here (a LaunchError with its last line when it does not unpickle), a note
    naming the rank, its traceback as the cause."""
    where = f"raised on rank {rank} of {world_size} in {_name(fn)}"
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - an exception class that does not rebuild from its args
        exc = None
    if not isinstance(exc, BaseException):
        exc = LaunchError(f"rank {rank} of {world_size} raised {_last_line(trace)}")
    exc.add_note(where)
    exc.__cause__ = RemoteTraceback(trace)
    return exc


def _stuck_report(
    stuck: Sequence[_Rank], world_size: int, fn: Callable[..., Any], timeout_s: float | None
) -> str:
    """Ask the stuck ranks for their Python stacks (SIGUSR1) and return them as one message."""
    line = (
        f"{_name(fn)}: ranks {[r.rank for r in stuck]} of {world_size} still running after {timeout_s} s; "
        + "their Python stacks at the timeout:"
    )
    return "\n".join([line, *_dump_stacks([r for r in stuck if r.process.is_alive()] or list(stuck))])


def _stack_text(r: _Rank) -> str:
    return r.stack_path.read_text(errors="replace") if r.stack_path.exists() else ""


def _kill(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL every live process and reap it (the ranks ignore SIGTERM: a failed or interrupted launch ends
    them at once)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def _reap(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Wait REAP_GRACE_S for ranks that reported to exit, then SIGKILL those still there."""
    give_up = time.monotonic() + REAP_GRACE_S
    for process in processes:
        process.join(max(give_up - time.monotonic(), 0.0))
    _kill(processes)


def _run_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    device: str,
    collective_timeout_s: float | None,
    stack_path: str,
    writer: Connection,
    caller: tuple[dict[str, str], str, Callable[..., str], int],
) -> None:
    """One rank: SIGINT and SIGTERM ignored, the caller's environment, folder and warning format plus the
    rank's variables, the launcher watched (`watch_launcher`), stack dumps on SIGUSR1, process group,
    fn(*args), then one report to the parent (none when the launcher is gone: the rank just exits)."""
    for sig in STOP_SIGNALS:  # as the forkserver set them (`rank_signals`), also for one started elsewhere
        signal.signal(sig, signal.SIG_IGN)
    environment, folder, warnings.formatwarning, launcher = caller
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(folder)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # tqdm's default write lock is a multiprocessing lock whose semaphore a rank leaves to the resource
    # tracker (a "leaked semaphore" warning at exit); a rank's bars never share a terminal line with another
    # process's, so a thread lock is enough
    tqdm.set_lock(threading.RLock())
    watch_launcher(launcher, writer.fileno())
    stack_file = open(stack_path, "w")  # noqa: SIM115 - faulthandler writes to it until the process ends
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        timeout = None if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
        if device == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", rank))
        else:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
            dist.init_process_group("gloo", timeout=timeout)
        report: tuple[Any, ...] = ("ok", fn(*args))
        payload = pickle.dumps(report)
    except BaseException as exc:  # noqa: BLE001 - anything is reported to the parent, which re-raises it
        payload = pickle.dumps(("error", _pickled_or_none(exc), traceback.format_exc()))
    try:
        if launcher_lost():  # nobody to report to
            raise BrokenPipeError
        writer.send_bytes(payload)
    except BrokenPipeError:  # the launcher is gone (it died after the check): end without a word
        os._exit(EXIT_ORPHANED)
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _pickled_or_none(exc: BaseException) -> bytes | None:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - unpicklable contents: the parent gets the traceback text
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))
