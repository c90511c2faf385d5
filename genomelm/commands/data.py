"""``genomelm data [CONFIG.yaml] [key=value ...]``: defaults from ``configs/data/<genome>.yaml`` (or the
config given), overridden by ``key=value`` settings (the old ``--flags`` still read, with a deprecation
line)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from genomelm.commands.keyvalue import ArgumentError, Option, as_switch, parse, usage
from genomelm.data.config import DataConfig, genome_config_path, load_yaml, shipped_inputs
from genomelm.data.errors import DataError
from genomelm.data.prepare import prepare
from genomelm.resources import shipped

PROG = "genomelm data"
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


OPTIONS = {
    "genome": Option("config name in configs/data (demo, hg38); with fasta=, the output name"),
    "config": Option("data config YAML (default: configs/data/<genome>.yaml); also the first argument"),
    "fasta": Option(
        "local genome: FASTA (plain, gzip or BGZF), GenBank or EMBL (plain or gzip, told apart by content) "
        "or UCSC .2bit; comma-separated or repeated for several files",
        repeatable=True,
    ),
    "seq": Option("tokens per window: 16k, 512k, 1M or an integer"),
    "stride": Option("tokens between window starts (default: seq)"),
    "train": Option(
        "comma-separated records, name:start-end (1-based inclusive) or BED files (.bed, .bed.gz; 0-based "
        "half-open) (default: everything not held out)"
    ),
    "heldout": Option("comma-separated records, name:start-end or BED files, as train="),
    "out": Option("output folder (default: data/prepared/<genome>-<seq>)"),
    "tokenizer": Option("local Hugging Face model folder whose A,C,G,T,N token ids to use"),
    "max_n_fraction": Option("drop windows with a larger N fraction (default 0.5)"),
    "allow_short": Option("pad records shorter than seq", switch=True),
    "base_url": Option("download folder for source hg38 (default: UCSC goldenPath/hg38)"),
    "cache": Option("download cache (default data/cache)"),
    "force": Option("rebuild even if up to date", switch=True),
    "progress": Option("progress bars (default true)", switch=True, flag="--no-progress", negate=True),
}
DESCRIPTION = (
    "Turn a genome (hg38 from UCSC, the bundled demo, or a FASTA, GenBank, EMBL or .2bit file) into "
    "seq-token windows."
)
EXAMPLES = (
    "examples:\n  genomelm data seq=16k                 # the bundled fly genome (genome=demo)\n"
    "  genomelm data genome=hg38 seq=512k\n"
    "  genomelm data fasta=my.fa.gz train=chrA,chrB heldout=chrC seq=1M out=data/prepared/mine"
)


def _fasta_stem(path: str) -> str:
    name = Path(path).name
    while name.lower().endswith(_FASTA_SUFFIXES):
        name = name[: name.rfind(".")]
    return name


def resolve_config(given: dict[str, str | list[str]]) -> DataConfig:
    """Config file settings (if any) overridden by the `key=value` settings given."""
    fasta = [path for item in given.get("fasta", []) for path in str(item).split(",") if path]
    settings: dict = {}
    # a relative config missing here may be a shipped one (configs/data/demo.yaml after a wheel install)
    config = shipped(str(given["config"])) if "config" in given else None
    if config is None and not fasta:
        genome = str(given.get("genome", "demo"))
        config = genome_config_path(genome)
        if not config.is_file():
            known = sorted(p.stem for p in config.parent.glob("*.yaml"))
            raise DataError(
                f"unknown genome {genome!r}: no {config} (known: {', '.join(known) or 'none'}); "
                "give fasta=FILE or config=FILE"
            )
    if config is not None:
        settings = shipped_inputs(load_yaml(config), config)
    for key in ("genome", "seq", "stride", "out", "tokenizer", "base_url", "cache"):
        if key in given:
            settings[key] = str(given[key])
    for key in ("train", "heldout"):
        if key in given:
            settings[key] = [item for item in str(given[key]).split(",") if item]
    for key in ("allow_short", "force"):
        if key in given:
            settings[key] = as_switch(key, str(given[key]))
    if "max_n_fraction" in given:
        try:
            settings["max_n_fraction"] = float(str(given["max_n_fraction"]))
        except ValueError:
            raise DataError(
                f"max_n_fraction={given['max_n_fraction']}: give a fraction between 0 and 1"
            ) from None
    if fasta:
        settings["fasta"] = fasta
        settings["source"] = "fasta"
        settings.setdefault("genome", _fasta_stem(fasta[0]))
    settings.setdefault("genome", Path(config).stem if config else "demo")
    return DataConfig(**settings)


def main(argv: list[str]) -> int:
    """Run ``genomelm data``; returns the exit status (2 on bad input, with the reason on stderr)."""
    try:
        args = parse(argv, OPTIONS, PROG)
        if args.help:
            print(usage(PROG, "[CONFIG.yaml] [key=value ...]", DESCRIPTION, OPTIONS, EXAMPLES))
            return 0
        if len(args.positional) > 1 or (args.positional and "config" in args.settings):
            raise ArgumentError(
                f"one data config at most (got {args.positional}); other settings are key=value, e.g. seq=16k"
            )
        if args.positional:
            args.settings["config"] = args.positional[0]
        progress = as_switch("progress", str(args.settings.pop("progress", "true")))
        cfg = resolve_config(args.settings)
        prepare(cfg, command=shlex.join(["genomelm", "data", *argv]), progress=progress)
    except (DataError, ArgumentError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
