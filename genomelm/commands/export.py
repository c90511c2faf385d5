"""`genomelm export RUN_DIR OUT [--dtype bf16|fp32] [--force]`: a sharded training checkpoint as a Hugging
Face folder, one layer at a time (`genomelm.parallel.export`)."""

from __future__ import annotations

import argparse
import sys

from genomelm.model.checkpoint import DEFAULT_MAX_SHARD_BYTES
from genomelm.parallel.export import DTYPES, export_checkpoint
from genomelm.run.failures import report_failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="genomelm export",
        description="Turn a sharded training checkpoint (torch.distributed.checkpoint) into a Hugging Face "
        "folder that genomelm and transformers load, one layer at a time.",
    )
    parser.add_argument(
        "run_dir", help="run folder (runs/<run>: its newest complete checkpoint) or a step folder"
    )
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="dtype of the weights (fp32-declared parameters stay fp32); default bf16",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="largest output shard in bytes (one tensor may exceed it)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        step = export_checkpoint(args.run_dir, args.out, DTYPES[args.dtype], args.force, args.max_shard_bytes)
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure("genomelm export", exc)
    print(f"exported {step} -> {args.out} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
