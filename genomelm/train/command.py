"""`genomelm train CONFIG [key=value ...]`: fine-tune on prepared windows (see `genomelm.train.config`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from genomelm.data import DataError
from genomelm.data.augment import crop_length
from genomelm.model.checkpoint import CheckpointError
from genomelm.model.config import MOE, ConfigError, is_preset
from genomelm.parallel.checkpoint import CheckpointSpaceError
from genomelm.parallel.launch import launch
from genomelm.parallel.layout import ContextLayout
from genomelm.parallel.mesh import ParallelDims
from genomelm.train.config import TrainConfig
from genomelm.train.guards import RunMismatch
from genomelm.train.loop import NonFiniteLoss, train
from genomelm.train.models import model_config_of, run_device
from genomelm.train.plan import PlanError, check_fits, describe_run
from genomelm.train.ray_launch import RayLaunchError, train_with_ray
from genomelm.train.run_lock import RunLock, RunLocked


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="genomelm train",
        description="Fine-tune GLM-5.3-Flash (or a preset of the same architecture) on prepared genome "
        "windows.",
        epilog="Any run setting can be overridden as key=value, e.g. steps=10 seq=1M dry_run=true.",
    )
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
    except (ValueError, FileNotFoundError, DataError) as exc:
        print(f"genomelm train: {exc}", file=sys.stderr)
        return 2
    if config.dry_run:
        print(describe_run(config))
        return 0
    try:
        summary = launch_training(config)
    except DataError as exc:
        print(
            f"genomelm train: {exc}\n  for this run: make data GENOME={config.genome} SEQ={config.seq} "
            f"(or set data=<prepared folder>)",
            file=sys.stderr,
        )
        return 2
    except (
        ValueError,
        FileNotFoundError,
        ConfigError,
        CheckpointError,
        NonFiniteLoss,
        RunMismatch,
        RunLocked,
        PlanError,
    ) as exc:
        print(f"genomelm train: {exc}", file=sys.stderr)
        return 2
    except (RayLaunchError, CheckpointSpaceError) as exc:
        print(f"genomelm train: {exc}", file=sys.stderr)
        return 1
    if "stopped" in summary:
        stopped = summary["stopped"]
        print(
            f"stopped by {stopped['signal']} after step {stopped['step']} of {summary['steps']}: checkpoint "
            f"{summary['checkpoint']}; the same command continues the run from there (resume=auto)"
        )
        return 0
    if not summary["losses"]:
        print(
            f"nothing to train: run {config.run} is at step {summary['start_step']} of {summary['steps']} "
            f"(checkpoint {summary['checkpoint']}); give steps= beyond it to train on"
        )
        return 0
    print(
        f"trained {config.run}: steps {summary['start_step']}..{summary['steps']}, "
        f"last loss {summary['losses'][-1] if summary['losses'] else float('nan'):.4f}, "
        f"skipped {summary['skipped']}, checkpoint {summary['checkpoint']}"
    )
    return 0


def launch_training(config: TrainConfig) -> dict:
    """Rank 0's training summary: one process (cp=1, local), dp * cp local processes, or dp * cp Ray Train
    workers. This process holds the run folder's lock (`RunLock`) throughout; the ranks do not."""
    with RunLock(config.run_dir):
        return _launch(config)


def _launch(config: TrainConfig) -> dict:
    # a run on GPUs (here, or on the Ray cluster at ray_address), or one planned for GPUs (gpus=N), is planned
    # first and refused if it cannot fit
    if (
        torch.cuda.is_available()
        or (config.parallel.launcher == "ray" and config.parallel.ray_address)
        or config.plan.gpus
    ):
        check_fits(config)
    if config.parallel.launcher == "ray":
        check_context_parallel(config)
        return train_with_ray(config)
    return train(config) if config.parallel.world == 1 else train_context_parallel(config)


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


def train_context_parallel(config: TrainConfig) -> dict:
    """`train(config)` on dp * cp local processes (gloo on the CPU, NCCL with one GPU each); rank 0's
    summary. A rank's error is raised here with its traceback; a hang is reported with every rank's stack."""
    check_context_parallel(config)
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
    )[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
