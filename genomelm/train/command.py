"""`genomelm train CONFIG [key=value ...]`: fine-tune on prepared windows (see `genomelm.train.config`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from genomelm.data import DataError
from genomelm.data.augment import crop_length
from genomelm.model.config import MOE, is_preset
from genomelm.parallel.launch import Interrupted, launch
from genomelm.parallel.layout import ContextLayout
from genomelm.parallel.mesh import ParallelDims
from genomelm.train.config import TrainConfig
from genomelm.train.failures import report_failure
from genomelm.train.loop import train
from genomelm.train.models import model_config_of, run_device
from genomelm.train.plan import check_fits, describe_run
from genomelm.train.ray_launch import train_with_ray
from genomelm.train.run_lock import RunLock
from genomelm.train.stop import StopSignals, stop_exit_code

PROG = "genomelm train"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="genomelm train",
        description="Fine-tune GLM-5.3-Flash (or a preset of the same architecture) on prepared genome "
        "windows.",
        epilog="Any run setting can be overridden as key=value, e.g. steps=10 seq=1M dry_run=true. Exit "
        "status: 0 done, 1 the machine (disk full, a lost rank), 2 the input (a setting, data, a "
        "checkpoint), 128+N stopped by signal N (143: SIGTERM, 130: SIGINT) with a checkpoint to continue "
        "from.",
    )
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        if config.dry_run:
            print(describe_run(config))
            return 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported as one line with its exit status
        return report_failure(PROG, exc)
    try:
        summary = launch_training(config)
    except Exception as exc:  # noqa: BLE001
        return report_failure(PROG, exc, config.run_dir, hint=_hint(config, exc))
    steps = summary["steps"]
    if "stopped" in summary:
        stopped = summary["stopped"]
        if stopped.get("first"):
            print(
                f"stopped by {stopped['signal']} before its first step (at step {stopped['step']} of "
                f"{steps}): nothing to save; the same command continues the run (resume=auto)"
            )
        else:
            print(
                f"stopped by {stopped['signal']} after step {stopped['step']} of {steps}: checkpoint "
                f"{summary['checkpoint']}; the same command continues the run from there (resume=auto)"
            )
        return stop_exit_code(stopped["signal"])
    if not summary["losses"]:
        print(
            f"nothing to train: run {config.run} is at step {summary['start_step']} of {steps} "
            f"(checkpoint {summary['checkpoint']}); give steps= beyond it to train on"
        )
        return 0
    print(
        f"trained {config.run}: steps {summary['start_step']}..{steps}, "
        f"last loss {summary['losses'][-1]:.4f}, skipped {summary['skipped']}, "
        f"checkpoint {summary['checkpoint']}"
    )
    return 0


def _hint(config: TrainConfig, exc: Exception) -> str | None:
    """What to do next, when the error's own message does not say: the data stage's command for missing
    data; how to continue after a run ended at once."""
    if isinstance(exc, DataError) and "rebuild it" not in str(exc):
        return (
            f"for this run: make data GENOME={config.genome} SEQ={config.seq} (or set data=<prepared folder>)"
        )
    if isinstance(exc, Interrupted):
        return "the same command continues the run from its newest checkpoint (resume=auto)"
    return None


def launch_training(config: TrainConfig) -> dict:
    """Rank 0's training summary: one process (cp=1, local), dp * cp local processes, or dp * cp Ray Train
    workers. The layout is checked first, so a refused one writes nothing; then this process holds the run
    folder's lock (`RunLock`) and turns signals into the run's stop request (`StopSignals`) throughout; the
    ranks do neither."""
    check_context_parallel(config)
    with RunLock(config.run_dir), StopSignals(config.run_dir) as signals:
        return _launch(config, signals)


def _launch(config: TrainConfig, signals: StopSignals) -> dict:
    # a run on GPUs (here, or on the Ray cluster at ray_address), or one planned for GPUs (gpus=N), is planned
    # first and refused if it cannot fit
    if (
        torch.cuda.is_available()
        or (config.parallel.launcher == "ray" and config.parallel.ray_address)
        or config.plan.gpus
    ):
        check_fits(config)
    if config.parallel.launcher == "ray":
        return train_with_ray(config, signals)
    return train(config) if config.parallel.world == 1 else train_context_parallel(config, signals)


def check_context_parallel(config: TrainConfig) -> None:
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
    steps = range(max(config.data_options.seq_warmup_steps, 0) + 1)
    lengths = {
        crop_length(
            step,
            config.data_options.seq_warmup_steps,
            config.seq_len,
            config.data_options.seq_warmup_start,
        )
        for step in steps
    }
    check_mesh(config, sorted(lengths))


def check_mesh(config: TrainConfig, lengths: list[int]) -> None:
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


def _train_on_rank(config: TrainConfig, threads: int) -> dict:
    torch.set_num_threads(threads)
    return train(config)


def train_context_parallel(config: TrainConfig, signals: StopSignals) -> dict:
    """`train(config)` on dp * cp local processes (gloo on the CPU, NCCL with one GPU each); rank 0's
    summary. A rank's error is raised here with its traceback; a hang is reported with every rank's stack. A
    signal to this process becomes the run's stop request (`signals`)."""
    device = run_device().type
    world = config.parallel.world
    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"dp={config.parallel.dp} x cp={config.parallel.cp} needs {world} GPUs on this machine, found "
            f"{torch.cuda.device_count()}"
        )
    threads = max(1, (os.cpu_count() or 1) // world)
    return launch(
        _train_on_rank,
        world,
        config,
        threads,
        device=device,
        collective_timeout_s=config.parallel.collective_timeout_s,
        on_signal=signals.request,
    )[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
