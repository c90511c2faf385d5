"""``genomelm data``: defaults from ``configs/data/<genome>.yaml`` (or ``--config``), overridden by flags."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from genomelm.data.config import DataConfig, genome_config_path, load_yaml
from genomelm.data.errors import DataError
from genomelm.data.prepare import prepare

_FASTA_SUFFIXES = (
    ".gz",
    ".bgz",
    ".fa",
    ".fasta",
    ".fna",
    ".fas",
    ".2bit",
    ".gb",
    ".gbk",
    ".gbff",
    ".genbank",
    ".embl",
    ".dat",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="genomelm data",
        description="Turn a genome (hg38 from UCSC, the bundled demo, or a FASTA, GenBank, EMBL or .2bit "
        "file) into SEQ-token windows.",
    )
    p.add_argument("--genome", help="config name in configs/data (demo, hg38); with --fasta, the output name")
    p.add_argument("--config", type=Path, help="data config YAML (default: configs/data/<genome>.yaml)")
    p.add_argument(
        "--fasta",
        action="append",
        help="local genome: FASTA (plain, gzip or BGZF), GenBank or EMBL (plain or gzip, told apart by "
        "content) or UCSC .2bit; repeat for several files",
    )
    p.add_argument("--seq", help="tokens per window: 16k, 512k, 1M or an integer")
    p.add_argument("--stride", help="tokens between window starts (default: SEQ)")
    p.add_argument(
        "--train",
        help="comma-separated records, name:start-end (1-based inclusive) or BED files (.bed, .bed.gz; "
        "0-based half-open) (default: everything not held out)",
    )
    p.add_argument("--heldout", help="comma-separated records, name:start-end or BED files, as --train")
    p.add_argument("--out", help="output folder (default: data/prepared/<genome>-<seq>)")
    p.add_argument("--tokenizer", help="local Hugging Face model folder whose A,C,G,T,N token ids to use")
    p.add_argument("--max-n-fraction", type=float, help="drop windows with a larger N fraction (default 0.5)")
    p.add_argument("--allow-short", action="store_true", default=None, help="pad records shorter than SEQ")
    p.add_argument("--base-url", help="download folder for source hg38 (default: UCSC goldenPath/hg38)")
    p.add_argument("--cache", help="download cache (default data/cache)")
    p.add_argument("--force", action="store_true", default=None, help="rebuild even if up to date")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _fasta_stem(path: str) -> str:
    name = Path(path).name
    while name.lower().endswith(_FASTA_SUFFIXES):
        name = name[: name.rfind(".")]
    return name


def resolve_config(args: argparse.Namespace) -> DataConfig:
    """Config file settings (if any) overridden by the flags that were given."""
    settings: dict = {}
    config = args.config
    if config is None and not args.fasta:
        genome = args.genome or "demo"
        config = genome_config_path(genome)
        if not config.is_file():
            known = sorted(p.stem for p in config.parent.glob("*.yaml"))
            raise DataError(
                f"unknown genome {genome!r}: no {config} (known: {', '.join(known) or 'none'}); "
                "give --fasta FILE or --config FILE"
            )
    if config is not None:
        settings = load_yaml(config)
    flags = {
        "genome": args.genome,
        "fasta": args.fasta,
        "seq": args.seq,
        "stride": args.stride,
        "out": args.out,
        "tokenizer": args.tokenizer,
        "max_n_fraction": args.max_n_fraction,
        "allow_short": args.allow_short,
        "base_url": args.base_url,
        "cache": args.cache,
        "force": args.force,
        "train": args.train.split(",") if args.train else None,
        "heldout": args.heldout.split(",") if args.heldout else None,
    }
    settings.update({k: v for k, v in flags.items() if v is not None})
    if args.fasta:
        settings["source"] = "fasta"
        settings.setdefault("genome", _fasta_stem(args.fasta[0]))
    settings.setdefault("genome", Path(config).stem if config else "demo")
    return DataConfig(**settings)


def main(argv: list[str]) -> int:
    """Run ``genomelm data``; returns the exit status (2 on bad input, with the reason on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        prepare(cfg, command=shlex.join(["genomelm", "data", *argv]), progress=not args.no_progress)
    except DataError as err:
        print(f"genomelm data: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("genomelm data: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
