"""`launcher=env`: this process is one rank of a group that torchrun or srun started, one process per rank.

The rank layout comes from the environment they set (`rank_layout`):
- torchrun (also under srun): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- srun alone: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE with SLURM_NODEID, and as the
  rendezvous MASTER_ADDR or the first host of SLURM_STEP_NODELIST (SLURM_JOB_NODELIST), MASTER_PORT or a port
  taken from SLURM_JOB_ID (the same on every task of the job).

`join_group(config)` checks that layout against the run's dp x cp before any rendezvous (each rank refuses a
mismatch with the same line), gives the rank its GPU (LOCAL_RANK) or its share of the node's cores, and starts
the default process group once for the process (NCCL on GPUs, gloo on the CPU). The group stays up until the
process exits, so a command's later scoring runs and its writes (`is_output_rank`: rank 0 only) see it.
Ranks other than 0 print nothing on stdout; their errors still reach stderr.

`before_joining(check)` runs the plan check on rank 0 before the rendezvous (the planner traces on a fake
group of its own). `held_by_rank_zero(run_dir, first)`: rank 0 holds the run folder's lock (`RunLock`, on the
file system every node shares) for the block, after clearing a stop request an earlier run left and calling
`first` (the plan check's outcome); what it raises there, every rank raises. Signals:
`genomelm.run.stop.RankStopSignals`. A rank torchrun started watches it (`watch_launcher`): killed outright,
its ranks stop at their next step without saving.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from genomelm.parallel.launcher_watch import watch_launcher
from genomelm.run.config import TrainConfig
from genomelm.run.lock import RunLock
from genomelm.run.models import run_device
from genomelm.run.stop import clear_stop_file

T = TypeVar("T")
SLURM_PORT_BASE = 15000  # MASTER_PORT under srun without one: this + SLURM_JOB_ID % SLURM_PORT_SPAN
SLURM_PORT_SPAN = 20000


class RankLayoutError(ValueError):
    """The environment names no rank layout, or not the one the run needs; the message says the fix."""


@dataclass(frozen=True)
class RankLayout:
    """This process's place in the group, as its launcher (`source`: "torchrun" or "srun") set it."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    source: str


def rank_layout(environ: Mapping[str, str] | None = None) -> RankLayout:
    """The rank layout torchrun or srun left in `environ` (default: this process's environment)."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env:
        missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise RankLayoutError(
                f"launcher=env: RANK is set but not {', '.join(missing)}: start the ranks with torchrun "
                "(it sets them all), or set them"
            )
        local_rank = _int(env, "LOCAL_RANK", "0")
        return RankLayout(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            local_rank,
            _int(env, "LOCAL_WORLD_SIZE", str(local_rank + 1)),
            env["MASTER_ADDR"],
            _int(env, "MASTER_PORT"),
            "torchrun",
        )
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not env.get("MASTER_ADDR") and not nodes:
            raise RankLayoutError(
                "launcher=env under srun: no SLURM_JOB_NODELIST and no MASTER_ADDR: set one"
            )
        if not env.get("MASTER_PORT") and not env.get("SLURM_JOB_ID"):
            raise RankLayoutError("launcher=env under srun: no SLURM_JOB_ID, no MASTER_PORT: set one")
        per_node = tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS", "1"))
        port = env.get("MASTER_PORT") or str(SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN)
        return RankLayout(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID", "0"),
            per_node[min(_int(env, "SLURM_NODEID", "0"), len(per_node) - 1)],
            env.get("MASTER_ADDR") or first_host(nodes or ""),
            int(port),
            "srun",
        )
    raise RankLayoutError(
        "launcher=env: no rank in the environment (torchrun sets RANK and WORLD_SIZE, srun SLURM_PROCID and "
        "SLURM_NTASKS): start one process per rank with torchrun or srun, or use launcher=local"
    )


def _int(env: Mapping[str, str], key: str, default: str | None = None) -> int:
    text = env.get(key, default)
    try:
        return int(text if text is not None else "")
    except ValueError:
        raise RankLayoutError(f"launcher=env: {key}={text!r} is not a whole number") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu[007-010,012],login1" -> "gpu007". Only the first is needed,
    so this is written here (`scontrol show hostnames` expands the whole list, but is not on every node)."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], nodelist[:end])
    if not host:
        raise RankLayoutError(f"launcher=env under srun: no host in the node list {nodelist!r}")
    return host


def tasks_per_node(text: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE, one entry per node: "8(x2),4" -> [8, 8, 4]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise RankLayoutError(
                f"launcher=env under srun: SLURM_TASKS_PER_NODE={text!r} is not Slurm's form"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


_joined: RankLayout | None = None


def join_group(config: TrainConfig) -> RankLayout:
    """This rank's layout, checked against the run's dp x cp, with the process group started (once per
    process; see the module docstring)."""
    global _joined
    layout = _joined or rank_layout()
    parallel = config.parallel
    if layout.world != parallel.world:
        raise RankLayoutError(
            f"launcher=env: {layout.source} started {layout.world} ranks and the run's dp={parallel.dp} x "
            f"cp={parallel.cp} needs {parallel.world}: start {parallel.world} (torchrun --nnodes N "
            f"--nproc-per-node M with N x M = {parallel.world}, or srun --ntasks={parallel.world}) or set dp "
            "and cp to match"
        )
    if _joined is not None:
        return _joined
    os.environ.update(
        RANK=str(layout.rank),
        WORLD_SIZE=str(layout.world),
        LOCAL_RANK=str(layout.local_rank),
        LOCAL_WORLD_SIZE=str(layout.local_world),
        MASTER_ADDR=layout.master_addr,
        MASTER_PORT=str(layout.master_port),
    )
    if layout.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 alone prints, for the process's life
    timeout = timedelta(seconds=parallel.collective_timeout_s)
    if run_device().type == "cuda":
        # srun --gpus-per-task=1 (or --gpu-bind) shows each task only its own GPU
        device = torch.device("cuda", layout.local_rank if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // layout.local_world))
        dist.init_process_group("gloo", timeout=timeout)
    atexit.register(_leave_group)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's agent started this rank: it never outlives it
        watch_launcher(os.getppid())
    _joined = layout
    return layout


def _sendable(exc: BaseException) -> BaseException:
    """`exc`, or for the other ranks its message when it does not pickle."""
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - unpicklable contents: the other ranks get its message
        return RuntimeError(str(exc))
    return exc


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def before_joining(check: Callable[[], object]) -> Callable[[], None]:
    """`check()` (the planner's) on the rank that will be rank 0, before the rendezvous: the planner traces
    the step on a fake process group of its own, which a live group would stand in the way of. Returns what to
    call once the group is up: it raises, on rank 0, what `check` raised (`from_rank_zero` then raises it on
    every rank)."""
    failure: list[Exception] = []
    if rank_layout().rank == 0:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - raised on every rank once they have joined
            failure.append(exc)

    def replay() -> None:
        if failure:
            raise failure[0]

    return replay


def from_rank_zero(make: Callable[[], T]) -> T:
    """`make()` on rank 0 of the joined group; its value on every rank, or its error raised on every rank
    (the value must pickle)."""
    value: T | None = None
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            value = make()
        except Exception as exc:  # noqa: BLE001 - every rank raises it, below
            failure = exc
    sent: list[object] = [("error", _sendable(failure)) if failure is not None else ("ok", value)]
    dist.broadcast_object_list(sent, src=0)
    if failure is not None:
        raise failure
    kind, payload = sent[0]
    if kind == "error":
        raise payload
    return payload


@contextmanager
def held_by_rank_zero(run_dir: Path, first: Callable[[], object] = lambda: None) -> Iterator[None]:
    """Rank 0 holds the run folder's lock for the block (see the module docstring); every rank of the
    joined group enters it or raises the same error."""
    lock = RunLock(run_dir)

    def take() -> None:
        lock.acquire()
        try:
            clear_stop_file(run_dir)
            first()
        except BaseException:
            lock.release()
            raise

    from_rank_zero(take)
    try:
        yield
    finally:
        if dist.get_rank() == 0:
            lock.release()
