"""What the scoring commands (`genomelm eval`, `probe`, `track`, `variants`, `embed`) share: their arguments
(`CONFIG [key=value ...] [--before PATH] [--after PATH]`), the layout and plan checks before any process
starts, the run on the mesh (`genomelm.run.launchers.on_ranks`), and printing the result before writing it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from genomelm.eval.evaluate import check_context_cut
from genomelm.eval.report import WriteError
from genomelm.parallel.launch import is_output_rank
from genomelm.run.config import TrainConfig
from genomelm.run.env_launch import before_joining, from_rank_zero, join_group
from genomelm.run.failures import report_failure
from genomelm.run.launchers import check_mesh, needs_plan, on_ranks


def parse_run_args(argv: list[str], prog: str, description: str, epilog: str) -> argparse.Namespace:
    """`CONFIG [key=value ...] [--before PATH] [--after PATH]`, as every scoring command takes."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run settings to override")
    parser.add_argument("--before", help="model before training (default: the run's base model)")
    parser.add_argument("--after", help="model after training (default: the run's newest checkpoint)")
    return parser.parse_intermixed_args(argv)


def run_scoring(score: Callable[..., dict], config: TrainConfig, *args: object) -> dict:
    """`score(config, *args)` in this process, or with dp * cp > 1 or ep > 1 on the run's mesh (local ranks,
    Ray Train workers, or the ranks torchrun or srun started): rank 0's result (under launcher=env, this
    rank's). `check_scoring` first. `score` is a module-level function (the ranks receive it pickled)."""
    check_scoring(config)
    return on_ranks(score, config, *args)


def check_scoring(config: TrainConfig) -> None:
    """The layout (and the context cut's) checked; on GPUs (or planned for them: gpus=N, a Ray cluster) the
    evaluation planned and refused if it cannot fit. Under launcher=env the plan runs on rank 0 before the
    rendezvous and its refusal is raised on every rank; the group is then up."""
    check_mesh(config, [config.seq_len])  # dp x cp x ep against the model, windows the cp ranks can split
    check_context_cut(config)
    if not needs_plan(config):
        return

    def plan() -> None:
        from genomelm.plan.check import check_fits  # imported when needed: it brings the torch compiler

        check_fits(config.replace(stage="eval"))

    if config.parallel.launcher != "env":
        plan()
        return
    planned = before_joining(plan)
    join_group(config)
    from_rank_zero(planned)


def print_written(prog: str, table: str, write: Callable[[], dict[str, Path]]) -> int:
    """Print the result table, `write()` the result's files, then print where its JSON, CSV, per-window file
    (eval's) and figure went: 0. When the write fails (WriteError: disk full, no permission) the table is
    printed all the same and the error as one line `prog: ...` on stderr: 1. Under launcher=env only rank 0
    writes (the others: 0)."""
    if not is_output_rank():
        return 0
    print()
    print(table)
    try:
        paths = write()
    except WriteError as exc:
        return report_failure(prog, exc)
    print(f"\nwrote {paths['json']} and {paths['csv']}")
    if "windows" in paths:
        print(f"per window: {paths['windows']}")
    print(f"figure: {paths['figure']}")
    return 0
