"""`genomelm train CONFIG [key=value ...]`: fine-tune on prepared windows (see `genomelm.train.config`)."""

from __future__ import annotations

import argparse
import sys

from genomelm.data import DataError
from genomelm.train.config import TrainConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="genomelm train",
        description="Fine-tune GLM-5.3-Flash (or a preset of the same architecture) on prepared genome windows.",
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
        from genomelm.train.plan import describe_run

        print(describe_run(config))
        return 0
    from genomelm.model.checkpoint import CheckpointError
    from genomelm.model.config import ConfigError
    from genomelm.train.guards import RunMismatch
    from genomelm.train.loop import NonFiniteLoss, train

    try:
        summary = train(config)
    except DataError as exc:
        print(f"genomelm train: {exc}\n  for this run: make data GENOME={config.genome} SEQ={config.seq} "
              f"(or set data=<prepared folder>)", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ConfigError, CheckpointError, NonFiniteLoss, RunMismatch) as exc:
        print(f"genomelm train: {exc}", file=sys.stderr)
        return 2
    print(f"trained {config.run}: steps {summary['start_step']}..{summary['steps']}, "
          f"last loss {summary['losses'][-1] if summary['losses'] else float('nan'):.4f}, "
          f"skipped {summary['skipped']}, checkpoint {summary['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
