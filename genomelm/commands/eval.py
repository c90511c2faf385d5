"""`genomelm eval CONFIG [key=value ...] [--before PATH] [--after PATH]`: held-out loss per position bucket,
before and after training (`genomelm.eval.evaluate`), written to `results/<run>/buckets.json`, `buckets.csv`
and `loss_by_position.png`. "after" is by default the run's newest checkpoint, read directly when it is
sharded."""

from __future__ import annotations

import sys

from genomelm.commands.scoring import parse_run_args, print_written, run_scoring
from genomelm.eval.evaluate import check_bucket, evaluate_config, write_outputs
from genomelm.eval.table import format_table
from genomelm.run.config import TrainConfig
from genomelm.run.failures import report_failure
from genomelm.run.models import model_pair

PROG = "genomelm eval"


def main(argv: list[str] | None = None) -> int:
    args = parse_run_args(
        list(sys.argv[1:] if argv is None else argv),
        prog=PROG,
        description="Held-out loss per position bucket, before and after training.",
        epilog="example: genomelm eval configs/train/hg38-512k.yaml bucket=65536 eval_windows=8",
    )
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        check_bucket(config.eval.bucket, config.seq_len)
        before, after = model_pair(config, args.before, args.after)
        result = run_scoring(evaluate_config, config, before, after)
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    return print_written(PROG, format_table(result), lambda: write_outputs(result, config.results_path))
