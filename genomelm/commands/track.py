"""`genomelm track CONFIG [key=value ...] [--before PATH] [--after PATH]`: per-base loss tracks (bigWig,
bedGraph) before and after training, their change and the long-context gain (`genomelm.eval.tracks`)."""

from __future__ import annotations

import argparse
import sys

from genomelm.commands.scoring import parse_run_args, run_scoring
from genomelm.eval.report import WriteError
from genomelm.eval.tracks import (
    TrackError,
    cut_tokens,
    format_track_table,
    plan_tracks,
    track_config,
    write_tracks,
)
from genomelm.parallel.launch import is_output_rank
from genomelm.run.config import TrainConfig
from genomelm.run.failures import report_failure
from genomelm.run.launchers import check_mesh
from genomelm.run.models import model_pair

PROG = "genomelm track"


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_run_args(
        argv,
        prog="genomelm track",
        description="Per-base loss tracks (bigWig, bedGraph) before and after training, their change and the "
        "long-context gain, of the held-out windows or of region=chr:start-end|file.bed.",
        epilog="example: genomelm track configs/train/demo.yaml region=NC_004353.4:1200001-1232766 "
        "(2 windows of SEQ - 1 = 16,383 bases)",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        cut = cut_tokens(config, config.seq_len)
        before, after = model_pair(config, args.before, args.after)
        plan = plan_tracks(config)
        check_mesh(config, [config.seq_len])
        try:
            check_mesh(config, [2 * cut])
        except ValueError as exc:
            raise TrackError(
                f"the short-context loss reads crops of 2 x {cut} tokens, which cp={config.parallel.cp} "
                f"cannot split ({exc}); give a context_cut_tokens= that it can"
            ) from None
        # the tracks run their own short context (checked above), not the evaluator's context cut
        result = run_scoring(track_config, config.replace(context_cut=False), before, after, plan)
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    if not is_output_rank():  # launcher=env: rank 0 writes the results
        return 0
    print()
    print(format_track_table(result))
    folder = config.results_path / "tracks"
    try:
        paths = write_tracks(result, folder)
    except WriteError as exc:
        return report_failure(PROG, exc)
    print(f"\nwrote {folder}/: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
