"""A run's ranks as Ray Train workers, one per rank: `launcher=ray` (`genomelm.run.launchers.on_ranks`).

Ray Train's `TorchTrainer` starts dp * cp workers (one GPU each on a cluster with GPUs, NCCL; else CPU workers
sharing the cores, gloo), sets up the default process group (its timeout `collective_timeout_s`), and each
worker runs the same function as a rank of the local launcher (`genomelm.parallel.launch`): training's
`train(config)` or a command's scoring. Rank 0 leaves its result in the run folder for the driver (Ray Train
keeps a worker's reported metrics only with a checkpoint).

When a worker dies, Ray stops the group and, up to `max_failures` times, starts it again; restarted training
ranks continue from the newest complete checkpoint (`resume=auto`; one a killed rank left half-written is a
temporary folder that is never read and is removed) with the same data order and RNG state, so the losses
equal those of an uninterrupted run; scoring keeps no state and scores from the start.

Signals stay the driver's from start to end. While Ray's `init` starts the node, a signal is held and acted
on once it is up (`_StartingRay`: `init` would answer SIGTERM with SystemExit halfway, leaving its agents
running); `fit` runs in a helper thread so Ray Train installs no SIGINT handler. In training the first signal
becomes the run's stop request (`genomelm.run.stop`), which the workers read from the run folder before their
first step; a second one, or any signal while scoring, ends the driver at once and Ray is shut down.

`ray_address` joins an existing cluster ("auto" on a node of it, or "ray://head:10001"); without it a local
Ray starts with no dashboard, no authentication and no preemption watcher, and stops when the run ends. The
driver's working directory (where `runs/`, `data/` and relative paths live) must exist at the same path on
every node: a shared file system on a cluster.

Ray is imported inside the functions: it is slow to import, and `start_ray` sets its environment first.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from genomelm.parallel.launch import STOP_SIGNALS, Interrupted
from genomelm.run.config import TrainConfig
from genomelm.run.ray_logging import WORKER_SETUP_HOOK, quiet_ray_loggers
from genomelm.run.stop import StopSignals

QUIET_ENVIRONMENT = {
    "RAY_AUTH_MODE": "disabled",  # no token prompt for a cluster this process starts on localhost
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage-stats banner
    "RAY_TRAIN_V2_ENABLED": "1",  # the Train API whose failure handling this module relies on
}


class RayLaunchError(RuntimeError):
    """A Ray run that could not start or that failed other than by a rank's own exception."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


def start_ray(address: str | None = None) -> None:
    """Connect to the cluster at `address`, or start a local Ray (no dashboard, no authentication, no
    preemption watcher); Ray's own chatter is kept to warnings in this process and in every worker it
    starts."""
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if address is None:  # Ray Train's preemption watcher polls the nodes for drains: the one node is this one
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    import ray

    ray.init(
        address=address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK},
    )


def run_with_ray(
    fn: Callable[..., Any], config: TrainConfig, *args: Any, signals: StopSignals | None = None
) -> Any:
    """`fn(config, *args)` on dp * cp Ray Train workers, the process group set up as for the local launcher;
    rank 0's result, which it pickles into a file of the run folder (on the file system every node shares)
    for this driver to read. A rank's exception is raised here once the restarts allowed by `max_failures`
    are spent. With `signals` (training's, `genomelm.run.stop`) the first signal becomes the run's stop
    request, which the workers read from the run folder; without them, or on a second signal, the driver ends
    at once (`Interrupted`) and Ray is shut down."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started_here = not ray.is_initialized()
    answer = _answer_path(config.run_dir)
    try:
        with _signals_while_running(signals):
            if started_here:
                with _StartingRay(signals):
                    start_ray(config.parallel.ray_address)
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
            workers = config.parallel.world
            trainer = TorchTrainer(
                _worker,
                train_loop_config={
                    "call": (fn, (config, *args)),
                    "answer": str(answer),
                    "cwd": os.getcwd(),
                    "environment": _forwarded_environment(),
                },
                torch_config=TorchConfig(
                    backend="nccl" if use_gpu else "gloo",
                    timeout_s=math.ceil(config.parallel.collective_timeout_s),  # Ray takes whole seconds
                ),
                scaling_config=ScalingConfig(
                    num_workers=workers,
                    use_gpu=use_gpu,
                    resources_per_worker=_resources_per_worker(workers, use_gpu),
                ),
                run_config=RunConfig(
                    name=config.run,
                    storage_path=str(Path(config.runs_dir).resolve()),
                    failure_config=FailureConfig(max_failures=config.parallel.max_failures),
                ),
            )
            try:
                _InThread(trainer.fit, "ray-train-fit").wait()
            except ray.train.TrainingFailedError as exc:
                raise _rank_error(exc) from exc
        return _read_answer(answer)
    finally:
        shutil.rmtree(answer.parent, ignore_errors=True)
        if started_here:
            ray.shutdown()


def _worker(payload: dict[str, Any]) -> None:
    """One rank: the driver's working directory, environment, its cores and GPU, then the call; rank 0 writes
    the result where the driver reads it."""
    context = _enter_worker(payload)
    fn, args = payload["call"]
    result = fn(*args)
    if context.get_world_rank() == 0:
        _write_answer(Path(payload["answer"]), result)


def _answer_path(run_dir: Path) -> Path:
    """Where rank 0 leaves its result for the driver: a fresh folder of the run folder (on the file system
    every node shares), since Ray Train keeps the metrics a worker reports only with a checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".ray-result-", dir=run_dir)).resolve() / "result.pkl"


def _write_answer(answer: Path, result: Any) -> None:
    """Pickle `result` to `answer` (a temporary name, renamed into place: the driver never reads half)."""
    partial = answer.with_suffix(".partial")
    with open(partial, "wb") as handle:
        pickle.dump(result, handle)
    os.replace(partial, answer)


def _read_answer(answer: Path) -> Any:
    with open(answer, "rb") as handle:
        return pickle.load(handle)


class _StartingRay:
    """`with _StartingRay(signals): ray.init(...)`: SIGTERM and SIGINT are held while Ray starts its node,
    then acted on as `signals` would (or as `Interrupted` without them). Ray's `init` would put in a handler
    that exits mid-start; replacing Ray's private `set_sigterm_handler` for the call is the one way to keep
    ours, since Ray starts its processes from the calling thread and they die with it (a prctl death
    signal), so `init` cannot run in a helper thread."""

    def __init__(self, signals: StopSignals | None) -> None:
        self.signals = signals
        self.held: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        import ray._private.utils

        self._ray_setter = ray._private.utils.set_sigterm_handler
        ray._private.utils.set_sigterm_handler = lambda handler: None
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._hold) for sig in STOP_SIGNALS}

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.held.append(signum)

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        import ray._private.utils

        ray._private.utils.set_sigterm_handler = self._ray_setter
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if error is not None:
            return
        for signum in self.held:
            if self.signals is None:
                raise Interrupted(signum)
            self.signals.handle(signum)


class _InThread:
    """`call()` in a helper thread while the main thread waits in short joins (`wait`): the main thread keeps
    the signal handlers in place (Ray Train installs its own SIGINT handler when `fit` runs in the main
    thread), and an exception a handler raises ends the wait within 0.2 s. `call`'s own exception is raised
    by `wait`."""

    def __init__(self, call: Callable[[], Any], name: str) -> None:
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            self.outcome["error"] = exc

    def wait(self) -> Any:
        self.thread.start()
        while self.thread.is_alive():
            self.thread.join(0.2)
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["result"]


@contextmanager
def _signals_while_running(signals: StopSignals | None) -> Iterator[None]:
    """While Ray starts and runs the workers: `signals` in place; without them a SIGTERM or SIGINT to the
    driver ends it at once (`Interrupted`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signals is not None:
        signals.install()
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forwarded_environment() -> dict[str, str]:
    """The driver's variables a worker must see: genomelm's own (GENOMELM_DEBUG, the test fault hook
    GENOMELM_FAULT of `genomelm.train.faults`)."""
    return {key: value for key, value in os.environ.items() if key.startswith("GENOMELM_")}


def _resources_per_worker(workers: int, use_gpu: bool) -> dict[str, float]:
    """One GPU and that GPU's share of its node's CPUs; on CPUs, each worker an equal share of the
    cluster's."""
    import ray

    if use_gpu:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
        cpus = min(int(n.get("CPU", 0) // n["GPU"]) for n in nodes)
        return {"GPU": 1, "CPU": max(cpus, 1)}
    return {"CPU": max(int(ray.cluster_resources().get("CPU", 1)) // workers, 1)}


def _enter_worker(payload: dict[str, Any]) -> Any:
    """Set a worker up like a local rank: the driver's working directory and environment, its share of the
    cores, its GPU; returns its Ray Train context."""
    import ray
    import ray.train
    import torch

    folder = Path(payload["cwd"])
    if not folder.is_dir():
        raise RayLaunchError(
            f"the driver's working directory {folder} is not on this node: run from a folder every node "
            "mounts at the same path (runs/ and data/ live there)"
        )
    os.chdir(folder)  # Ray starts each worker in its own session folder
    os.environ.update(payload["environment"])
    quiet_ray_loggers()  # again: Ray Train sets its worker loggers up after the process setup hook
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(int(cpus), 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(ray.train.torch.get_device())
    return ray.train.get_context()


def _rank_error(exc: Exception) -> BaseException:
    """A lost worker (its process died: a kill, out of memory, a crash) as a RayLaunchError naming its rank,
    since the other ranks' errors only follow from it; else the lowest failed rank's own exception (a
    DataError stays a DataError)."""
    from ray.train.v2.api.exceptions import RayTrainError

    failures: dict[int, Exception] = getattr(exc, "worker_failures", None) or {}
    lost = sorted(rank for rank, error in failures.items() if isinstance(error, RayTrainError))
    if lost:
        return RayLaunchError(
            f"Ray Train worker rank {lost[0]} was lost (its process died: killed, out of memory or crashed) "
            f"and no restarts were left (max_failures): {failures[lost[0]]}"
        )
    if failures:
        rank = min(failures)
        failures[rank].add_note(f"raised on Ray Train worker rank {rank}")
        return failures[rank]
    return RayLaunchError(f"the Ray run failed: {exc}")
