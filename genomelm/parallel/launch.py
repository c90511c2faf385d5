"""Run a function on N processes of this machine, one rank each, torchrun style.

`launch(fn, world_size, *args, device="cpu", timeout_s=..., collective_timeout_s=...)` starts `world_size`
processes, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment and the default process group initialised (gloo on the CPU, each rank with its share of the cores;
NCCL with one GPU per rank on CUDA), calls `fn(*args)` there and returns the ranks' return values in rank
order (`fn`, its arguments and its results must pickle). Rank 0 is the rank that writes outputs
(`is_output_rank`). The processes fork from a multiprocessing forkserver that has imported torch once (it
never runs torch, so no threads or CUDA state are inherited); like spawn, they get nothing from the caller but
what is pickled, its sys.path, and (set first thing in each rank) its environment variables and working
directory.

Failures end the whole launch instead of hanging it:
- a rank raises: the other ranks are stopped and the parent re-raises that exception (same type and message,
  with a note naming the rank and the rank's traceback as its cause);
- a rank dies without reporting (a signal, os._exit): `LaunchError` naming it and its exit code or signal,
  also when the others' collectives fail first because of it (gloo raises "Connection closed by peer" at once
  on a peer that dies, or times out after `collective_timeout_s` where it had no connection to it yet);
- a collective that waits `collective_timeout_s` for a stuck peer: that rank raises (torch's timeout error);
- ranks still running after `timeout_s`: each dumps the Python stacks of all its threads (faulthandler on
  SIGUSR1), all are stopped, and `LaunchTimeout` carries the stacks in its message.

A SIGTERM or SIGINT to the launching process is passed on to the ranks as SIGTERM, and the launch goes on
collecting their reports (a training rank stops after its step and checkpoints); a second signal kills them.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

STOP_GRACE_S = 5.0  # how long a rank gets to exit after SIGTERM before SIGKILL
STACK_DUMP_WAIT_S = 5.0  # how long the ranks get to write their stacks after SIGUSR1
COLLECTIVE_TIMEOUT_MARGIN_S = 60.0  # no collective_timeout_s: the group's timeout is the launch's + this
DEATH_GRACE_S = 2.0  # how long a rank's error waits for another rank's death to show (it may follow from it)


class LaunchError(RuntimeError):
    """A launch that failed other than by a rank's own exception."""


class LaunchTimeout(LaunchError):
    """Ranks still running when the launch timed out; the message holds their Python stacks."""


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
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks ("cpu": gloo; "cuda": NCCL, rank r on GPU r) and return the
    results in rank order. `timeout_s`: the whole launch's limit (start-up included); None waits forever.
    `collective_timeout_s`: the process group's timeout; None: `timeout_s` plus COLLECTIVE_TIMEOUT_MARGIN_S
    (a hang is then reported by the launch timeout, with the stacks), or torch's default without one."""
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
    context.set_forkserver_preload([__name__])  # the server imports torch once; each rank forks from it
    port = _free_port()
    caller = (dict(os.environ), os.getcwd())
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="genomelm-launch-") as folder:
        try:
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
            with _forward_signals(ranks):
                return _collect(ranks, fn, timeout_s)
        finally:
            _stop([r.process for r in ranks])


def _collect(ranks: Sequence[_Rank], fn: Callable[..., Any], timeout_s: float | None) -> list[Any]:
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
                # a rank's collective fails when a peer dies (gloo: "Connection closed by peer"), and its
                # report can come in before the death shows: the dead rank is the one to name
                dead = _dead_rank(list(pending.values()), DEATH_GRACE_S)
                if dead is not None:
                    error = _death(dead, len(ranks), fn)
                    error.add_note(f"rank {r.rank} then raised {report[2].strip().splitlines()[-1]}")
                    raise error
                raise _rank_exception(report[1], report[2], r.rank, len(ranks), fn)
            results[r.rank] = report[1]
    return [results[rank] for rank in range(len(ranks))]


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


def _dead_rank(ranks: Sequence[_Rank], grace_s: float) -> _Rank | None:
    """The first of `ranks` seen to exit without reporting within `grace_s`; None when each one reports or is
    still running (their reports are dropped: the caller raises)."""
    give_up = time.monotonic() + grace_s
    waiting = list(ranks)
    while waiting and (remaining := give_up - time.monotonic()) > 0:
        ready = wait(_handles(waiting), remaining)
        for r in list(waiting):
            report = _take_report(r, ready)
            if report is None:
                continue
            if report[0] == "died":
                return r
            waiting.remove(r)
    return None


def _death(r: _Rank, world_size: int, fn: Callable[..., Any]) -> LaunchError:
    """The failure of a rank that exited without reporting, with its exit code or signal."""
    r.process.join(STOP_GRACE_S)  # its pipe can close just before the process is reaped
    return LaunchError(
        f"{_name(fn)}: rank {r.rank} of {world_size} exited with {_describe_exit(r.process.exitcode)} before "
        "reporting (its output, if any, is above)"
    )


@contextmanager
def _forward_signals(ranks: Sequence[_Rank]) -> Iterator[None]:
    """While the ranks run: the first SIGTERM or SIGINT to this process is passed on to every rank as SIGTERM
    (a rank that handles it finishes its work and reports as usual: `genomelm.train.stop`); a second one kills
    the ranks and ends the launch at once (SystemExit 128 + signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for r in ranks:
            if r.process.is_alive():
                if len(received) == 1:
                    os.kill(r.process.pid, signal.SIGTERM)
                else:
                    r.process.kill()
        if len(received) > 1:
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    """The rank's exception rebuilt here (LaunchError when it does not unpickle), its traceback as the
    cause."""
    where = f"raised on rank {rank} of {world_size} in {_name(fn)}"
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - an exception class that does not rebuild from its args
        exc = None
    if not isinstance(exc, BaseException):
        exc = LaunchError(f"{where}:\n{trace}")
    else:
        exc.add_note(where)
    exc.__cause__ = RemoteTraceback(trace)
    return exc


def _stuck_report(
    stuck: Sequence[_Rank], world_size: int, fn: Callable[..., Any], timeout_s: float | None
) -> str:
    """Ask the stuck ranks for their Python stacks (SIGUSR1) and return them as one message."""
    alive = [r for r in stuck if r.process.is_alive()]
    for r in alive:
        os.kill(r.process.pid, signal.SIGUSR1)
    give_up = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < give_up and not all(_stack_text(r) for r in alive):
        time.sleep(0.05)
    time.sleep(0.1)  # let the last dump finish writing
    lines = [
        f"{_name(fn)}: ranks {[r.rank for r in stuck]} of {world_size} still running after {timeout_s} s; "
        + "their Python stacks at the timeout:"
    ]
    for r in stuck:
        text = _stack_text(r) or "(no stack: the rank had not started its function yet, or had exited)"
        lines.append(f"--- rank {r.rank} ---\n{text.rstrip()}")
    return "\n".join(lines)


def _stack_text(r: _Rank) -> str:
    return r.stack_path.read_text(errors="replace") if r.stack_path.exists() else ""


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """SIGTERM every live process, SIGKILL those still alive after STOP_GRACE_S, and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    give_up = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(give_up - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
            process.join()


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
    caller: tuple[dict[str, str], str],
) -> None:
    """One rank: the caller's environment and folder plus the rank's variables, stack dumps on SIGUSR1,
    process group, fn(*args), then one report to the parent."""
    environment, folder = caller
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
    writer.send_bytes(payload)
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
