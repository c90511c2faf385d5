"""`genomelm variants CONFIG vcf=FILE [key=value ...] [--before PATH] [--after PATH]`: zero-shot variant
effects of a VCF's records (`genomelm.eval.variants`), written as an annotated VCF and a TSV."""

from __future__ import annotations

import argparse
import sys

from genomelm.commands.scoring import parse_run_args, run_scoring
from genomelm.eval.report import WriteError
from genomelm.eval.variants import (
    allele_scores,
    load_variants,
    result_rows,
    score_variants,
    summary,
    window_tokens,
    write_variant_outputs,
)
from genomelm.parallel.launch import is_output_rank
from genomelm.run.config import TrainConfig
from genomelm.run.failures import report_failure
from genomelm.run.models import model_pair

PROG = "genomelm variants"


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_run_args(
        argv,
        prog="genomelm variants",
        description="Zero-shot variant effects of a VCF's records: log P(ALT window) - log P(REF window), "
        "before and after training.",
        epilog="example: genomelm variants configs/train/demo.yaml vcf=variants.vcf.gz variant_context=4096",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        tokens = window_tokens(config)
        before, after = model_pair(config, args.before, args.after)
        variants = load_variants(config, tokens)
        scores = None
        if variants.plan.sites:
            # the passes are `tokens` long: the mesh and (on GPUs) the plan are checked for those
            scoring = config.replace(seq=str(tokens), data=str(config.data_dir), context_cut=False)
            scores = allele_scores(run_scoring(score_variants, scoring, variants.plan, before, after))
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    if not is_output_rank():  # launcher=env: rank 0 writes the results
        return 0
    rows = result_rows(variants, scores)
    print()
    print(summary(variants, rows))
    try:
        paths = write_variant_outputs(variants, rows, {"before": before, "after": after}, config.results_path)
    except WriteError as exc:
        return report_failure(PROG, exc)
    print(f"\nwrote {paths['variants.vcf.gz']} (+ .tbi) and {paths['variants.tsv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
