"""`genomelm train CONFIG [key=value ...]`: fine-tune on prepared windows (the settings:
`genomelm.run.config`; the loop: `genomelm.train.loop`)."""

from __future__ import annotations

import argparse
import sys

from genomelm.data import DataError
from genomelm.parallel.launch import Interrupted, is_output_rank
from genomelm.run.config import TrainConfig
from genomelm.run.env_launch import before_joining, held_by_rank_zero, join_group
from genomelm.run.failures import report_failure
from genomelm.run.launchers import check_layout, needs_plan, on_ranks
from genomelm.run.lock import RunLock
from genomelm.run.stop import RankStopSignals, StopSignals, stop_exit_code
from genomelm.train.loop import train

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
            from genomelm.plan.check import describe_run  # see `_plan`

            print(describe_run(config))
            return 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported as one line with its exit status
        return report_failure(PROG, exc)
    try:
        summary = launch_training(config)
    except Exception as exc:  # noqa: BLE001
        # one writer of failure.txt: rank 0 under launcher=env
        run_dir = config.run_dir if is_output_rank() else None
        return report_failure(PROG, exc, run_dir, hint=_hint(config, exc))
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
    workers (`genomelm.run.launchers`). The layout is checked first, so a refused one writes nothing; a run
    meant for GPUs is planned and refused if it cannot fit; then this process holds the run folder's lock
    (`RunLock`) and turns signals into the run's stop request (`StopSignals`) throughout; the ranks do
    neither. Under launcher=env this process is one of the ranks: each takes the signals itself
    (`RankStopSignals`) and rank 0 holds the lock and plans (`genomelm.run.env_launch`)."""
    check_layout(config)
    if config.parallel.launcher == "env":
        with RankStopSignals(config.run_dir):
            planned = before_joining(lambda: _plan(config))
            join_group(config)
            with held_by_rank_zero(config.run_dir, first=planned):
                return on_ranks(train_on_rank, config)
    with RunLock(config.run_dir) as lock, StopSignals(config.run_dir) as signals:
        _plan(config)
        return on_ranks(train_on_rank, config, signals=signals, lock=lock)


def _plan(config: TrainConfig) -> None:
    """Refuse a run meant for GPUs that the planner says cannot fit (`check_fits`)."""
    if needs_plan(config):
        # imported here: the planner brings the torch compiler stack (~2 s), and every rank of a launch
        # imports this module to unpickle `train_on_rank`
        from genomelm.plan.check import check_fits

        check_fits(config)


def train_on_rank(config: TrainConfig) -> dict:
    """`train(config)` on one rank (rank 0's summary is the run's)."""
    return train(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
