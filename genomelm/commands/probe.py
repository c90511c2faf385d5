"""`genomelm probe CONFIG [key=value ...] [--before PATH] [--after PATH]`: the copy probe
(`genomelm.eval.probe`), how far back the model retrieves a copied segment, before and after training."""

from __future__ import annotations

import argparse
import sys

from genomelm.commands.scoring import parse_run_args, print_written, run_scoring
from genomelm.eval.probe import (
    format_probe_table,
    parse_distances,
    probe_config,
    write_probe_outputs,
)
from genomelm.run.config import TrainConfig
from genomelm.run.failures import report_failure
from genomelm.run.models import model_pair

PROG = "genomelm probe"


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_run_args(
        argv,
        prog="genomelm probe",
        description="Copy probe: loss on a copied segment with its first copy d tokens earlier vs without "
        "it, before and after training.",
        epilog="example: genomelm probe configs/train/demo.yaml probe_distances=1k,4k probe_windows=2",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        parse_distances(config.probe.probe_distances)
        before, after = model_pair(config, args.before, args.after)
        result = run_scoring(probe_config, config, before, after)
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    table = format_probe_table(result)
    return print_written(PROG, table, lambda: write_probe_outputs(result, config.results_path))


if __name__ == "__main__":
    sys.exit(main())
