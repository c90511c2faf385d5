"""``DataConfig``: settings of ``genomelm data``, read from ``configs/data/<genome>.yaml`` and flags."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from genomelm import resources
from genomelm.data.download import UCSC_HG38
from genomelm.data.errors import DataError
from genomelm.data.regions import parse_seq, seq_label

SOURCES = ("fasta", "hg38")
CONFIG_DIR = Path("configs/data")


@dataclass
class DataConfig:
    """Everything that decides the prepared output; relative paths are relative to the working directory.

    ``source`` 'hg38' downloads ``files`` from ``base_url`` into ``cache``/hg38; 'fasta' reads ``fasta``.
    ``train``/``heldout`` are record names, ``name:start-end`` (1-based inclusive) or BED files (``.bed``,
    ``.bed.gz``; 0-based half-open); an empty ``train`` means every base not in ``heldout``. ``fasta`` files
    may be FASTA, GenBank, EMBL or .2bit. ``seq`` and ``stride`` are in tokens (= bases).
    """

    genome: str
    source: str = "fasta"
    fasta: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    base_url: str = UCSC_HG38
    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    seq: int = 16384
    stride: int | None = None
    max_n_fraction: float = 0.5
    allow_short: bool = False
    cache: str = "data/cache"
    out: str | None = None
    tokenizer: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        self.seq = parse_seq(self.seq)
        if self.stride is not None:
            self.stride = parse_seq(self.stride)
        if self.source not in SOURCES:
            raise DataError(f"source {self.source!r}: must be one of {', '.join(SOURCES)}")
        if not 0.0 <= self.max_n_fraction <= 1.0:
            raise DataError(f"max_n_fraction={self.max_n_fraction}: give a fraction between 0 and 1")
        for name in ("fasta", "files", "train", "heldout"):
            value = getattr(self, name)
            setattr(self, name, [value] if isinstance(value, str) else list(value))

    @property
    def window_stride(self) -> int:
        return self.stride or self.seq

    @property
    def out_dir(self) -> Path:
        """``out`` or ``data/prepared/<genome>-<seq label>``, e.g. data/prepared/demo-16k."""
        return Path(self.out) if self.out else Path("data/prepared") / f"{self.genome}-{seq_label(self.seq)}"


def load_yaml(path: str | Path) -> dict:
    """The mapping in a config file; unknown keys are an error naming the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise DataError(f"config={path}: cannot read it ({err.strerror})") from err
    except yaml.YAMLError as err:
        raise DataError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a mapping of settings at the top level")
    known = {f.name for f in fields(DataConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DataError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data


def genome_config_path(genome: str) -> Path:
    """``configs/data/<genome>.yaml`` under the working directory, else the shipped one (the checkout's, or
    the copy a wheel installed: `genomelm.resources`)."""
    return resources.shipped(CONFIG_DIR / f"{genome}.yaml")


def shipped_inputs(settings: dict, config: Path) -> dict:
    """`settings` of the data config `config` with each relative `fasta` path that is not in the working
    directory but ships with genomelm (`data/dmel_chr4.fa.gz` of configs/data/demo.yaml) made absolute."""
    if not resources.is_shipped(config, CONFIG_DIR):
        return settings
    fasta = settings.get("fasta")
    if isinstance(fasta, (str, list)):
        paths = [fasta] if isinstance(fasta, str) else fasta
        settings = settings | {"fasta": [str(resources.shipped(path)) for path in paths]}
    return settings
