"""`genomelm export RUN OUT [dtype=bf16|fp32] [force=true] [max_shard_bytes=N]`: a run's checkpoint (either
layout) as the Hugging Face folder users load, with its tokenizer and model card
(`genomelm.run.hf_folder`)."""

from __future__ import annotations

import sys

from genomelm.commands.keyvalue import ArgumentError, Option, as_switch, parse, usage
from genomelm.model.checkpoint import DEFAULT_MAX_SHARD_BYTES
from genomelm.parallel.export import DTYPES
from genomelm.run.failures import report_failure
from genomelm.run.hf_folder import export_run

PROG = "genomelm export"
OPTIONS = {
    "dtype": Option(
        f"weights' dtype, {' or '.join(sorted(DTYPES))} (fp32-declared parameters stay fp32); bf16"
    ),
    "force": Option("replace an existing non-empty OUT", switch=True),
    "max_shard_bytes": Option(
        f"largest weights file in bytes (one tensor may exceed it); {DEFAULT_MAX_SHARD_BYTES}"
    ),
}
DESCRIPTION = (
    "A run's checkpoint (one-process or sharded) as a Hugging Face folder: weights, config.json, a one-token-"
    "per-base tokenizer and a README.md model card; it loads with transformers' AutoConfig, "
    "AutoModelForImageTextToText and AutoTokenizer. RUN: a run folder (runs/<run>: its newest complete "
    "checkpoint) or a step folder; OUT: written to a temporary folder beside it, renamed in last."
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv, OPTIONS, PROG)
        if args.help:
            print(
                usage(
                    PROG,
                    "RUN OUT [key=value ...]",
                    DESCRIPTION,
                    OPTIONS,
                    "example: genomelm export runs/demo exports/demo dtype=fp32",
                )
            )
            return 0
        if len(args.positional) != 2:
            raise ArgumentError(
                f"give RUN and OUT (got {args.positional or 'none'}); e.g. {PROG} runs/demo out"
            )
        dtype = str(args.settings.get("dtype", "bf16"))
        if dtype not in DTYPES:
            raise ArgumentError(f"dtype={dtype}: give {' or '.join(sorted(DTYPES))}")
        force = as_switch("force", str(args.settings.get("force", "false")))
        shard = str(args.settings.get("max_shard_bytes", DEFAULT_MAX_SHARD_BYTES))
        if not shard.isdigit() or int(shard) < 1:
            raise ArgumentError(f"max_shard_bytes={shard}: give a whole number of bytes >= 1")
        run, out = args.positional
        source = export_run(run, out, DTYPES[dtype], force, int(shard))
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    print(f"exported {source.step} -> {out} ({dtype}); load it with transformers' Auto classes (README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
