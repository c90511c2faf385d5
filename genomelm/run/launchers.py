"""Where a run's ranks run: `on_ranks(fn, config, *args)` calls `fn(config, *args)` on the run's dp x cp mesh
and returns rank 0's result, whatever launches it:

- one process (dp * cp = 1, launcher=local): here;
- dp * cp local processes (`genomelm.parallel.launch`: gloo on the CPU, NCCL with one GPU each);
- dp * cp Ray Train workers (launcher=ray, `genomelm.run.ray_launch`), here or on the cluster at
  `ray_address`;
- this process as one of dp * cp ranks that torchrun or srun started (launcher=env,
  `genomelm.run.env_launch`): `fn` runs here on the group's mesh and this rank's result is returned (the
  commands write outputs on rank 0 only, `is_output_rank`).

Before any process starts, `check_layout` refuses a layout the model or the windows cannot split
(`check_mesh`), so a refused run writes nothing. Training and every scoring command go through here; each
command plans a run meant for GPUs first (`needs_plan`, `genomelm.plan.check`).
"""

from __future__ import annotations

import contextlib
import io
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from genomelm.data.augment import crop_length
from genomelm.model.config import MOE, is_preset
from genomelm.parallel.launch import STOP_SIGNALS, Interrupted, launch
from genomelm.parallel.layout import ContextLayout
from genomelm.parallel.mesh import ParallelDims
from genomelm.run.config import TrainConfig
from genomelm.run.env_launch import from_rank_zero, join_group
from genomelm.run.lock import RunLock
from genomelm.run.models import model_config_of, run_device
from genomelm.run.ray_launch import run_with_ray
from genomelm.run.stop import StopSignals


def needs_plan(config: TrainConfig) -> bool:
    """Whether the run is meant for GPUs (here, on the Ray cluster at `ray_address`, or planned for them:
    gpus=N), so it is planned first and refused if it cannot fit."""
    on_ray_cluster = config.parallel.launcher == "ray" and bool(config.parallel.ray_address)
    return torch.cuda.is_available() or on_ray_cluster or bool(config.plan.gpus)


def check_layout(config: TrainConfig) -> None:
    """Refuse, before any process starts, a dp x cp x ep layout that cannot train: ep not dividing dp*cp or
    the expert count, optimizer offload off a GPU, or a cp the run's windows (and warm-up crops) cannot split
    into."""
    if config.parallel.optimizer_offload:
        if run_device().type != "cuda" and not (
            config.parallel.launcher == "ray" and config.parallel.ray_address
        ):
            raise ValueError(
                "optimizer_offload=true runs on GPUs only (FSDP2's CPUOffloadPolicy moves state off a "
                "GPU); on this machine leave it false"
            )
    options = config.data_options
    steps = range(max(options.seq_warmup_steps, 0) + 1)
    lengths = {
        crop_length(step, options.seq_warmup_steps, config.seq_len, options.seq_warmup_start)
        for step in steps
    }
    check_mesh(config, sorted(lengths))


def check_mesh(config: TrainConfig, lengths: Sequence[int]) -> None:
    """Refuse a dp x cp x ep layout the model cannot split (ep not dividing dp*cp or the expert count) or a cp
    windows of `lengths` tokens cannot split into (training and evaluation alike)."""
    kpool, experts = 4, None
    if config.model and (is_preset(config.model) or Path(config.model, "config.json").exists()):
        model = model_config_of(config.model)
        kpool = model.index_kpool if model.dsa_layers else 1
        experts = model.n_routed_experts if MOE in model.mlp_layer_types else None
    ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep).check(experts)
    for length in lengths if config.parallel.cp > 1 else ():  # one rank per window splits nothing
        ContextLayout(
            length,
            config.parallel.cp,
            0,
            config.parallel.cp_layout,
            kda_chunk=config.model_options.kda_chunk_size,
            kpool=kpool,
        )


def on_ranks(
    fn: Callable[..., Any],
    config: TrainConfig,
    *args: Any,
    signals: StopSignals | None = None,
    lock: RunLock | None = None,
) -> Any:
    """`fn(config, *args)` on the run's mesh (see the module docstring); rank 0's result. `fn` is a
    module-level function (the ranks receive it pickled). `signals`: the lock holder's (training), which turn
    the first signal into the run's stop request; without them a signal ends the ranks at once
    (`Interrupted`). `lock`: the run folder's, which records the local launch's processes once they run."""
    if config.parallel.launcher == "ray":
        return run_with_ray(_on_rank, config, fn, *args, signals=signals)
    if config.parallel.launcher == "env":
        join_group(config)
        result = _on_rank(config, fn, *args)
        dist.barrier()  # every rank is done (its rows, its shards written), as a launcher waits for all
        return result
    ranks = config.parallel.world
    if ranks == 1:
        with _interrupted_by_signals() if signals is None else contextlib.nullcontext():
            return fn(config, *args)
    device = run_device().type
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ValueError(
            f"dp={config.parallel.dp} x cp={config.parallel.cp} needs {ranks} GPUs on this machine, found "
            f"{torch.cuda.device_count()}"
        )
    return launch(
        _on_rank,
        ranks,
        config,
        fn,
        *args,
        device=device,
        collective_timeout_s=config.parallel.collective_timeout_s,
        on_signal=signals.request if signals is not None else None,
        on_started=lock.add_processes if lock is not None else None,
    )[0]


@contextlib.contextmanager
def _interrupted_by_signals() -> Iterator[None]:
    """In the one process of a run without a stop request (scoring): SIGTERM or SIGINT raises `Interrupted`
    where the main thread is, so the command ends with its one line and 128 + the signal, as a launch
    does."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def on_rank_zero(config: TrainConfig, make: Callable[[], Any]) -> Any:
    """`make()` here (it prepares what the ranks share, e.g. an output file they fill); under launcher=env
    on rank 0 alone, its value (or its error) given to every rank."""
    if config.parallel.launcher != "env":
        return make()
    join_group(config)
    return from_rank_zero(make)


def _on_rank(config: TrainConfig, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(config, *args)` on one rank of `on_ranks`'s group (its launcher gave it its share of the cores);
    only rank 0 prints."""
    quiet = dist.is_initialized() and dist.get_rank() != 0
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return fn(config, *args)
