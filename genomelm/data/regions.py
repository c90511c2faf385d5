"""Split specifications (record names, samtools-style ``name:start-end`` or BED files) and SEQ sizes."""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from genomelm.data.errors import DataError

_SEQ_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}
_COORDS = re.compile(r"^([0-9,]+)-([0-9,]+)$")
BED_SUFFIXES = (".bed", ".bed.gz")
_BED_HEADERS = ("track", "browser")


def parse_seq(text: str | int) -> int:
    """'16k' -> 16384, '512k' -> 524288, '1M' -> 1048576, '4096' -> 4096 (tokens)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not match or int(match.group(1)) <= 0:
        raise DataError(f"seq={text!r}: give a positive token count such as 16k, 512k, 1M or 4096")
    return int(match.group(1)) * _SEQ_UNITS[match.group(2).lower()]


def seq_label(seq: int) -> str:
    """Inverse of :func:`parse_seq` for folder names: 16384 -> '16k', 1048576 -> '1M'."""
    if seq % (1024 * 1024) == 0:
        return f"{seq // (1024 * 1024)}M"
    if seq % 1024 == 0:
        return f"{seq // 1024}k"
    return str(seq)


@dataclass(frozen=True)
class Interval:
    """Bases [start, end) of ``record`` (0-based half-open; end None = to the record's end)."""

    split: str
    spec: str
    record: str
    start: int
    end: int | None
    origin: str = ""  # where a BED interval came from: "<file> line <n>"

    def describe(self) -> str:
        """How messages name it: ``'chr4:1-100' (train)`` or ``held.bed line 3: chr4:1-100 (heldout)``."""
        return (
            f"{self.origin}: {self.spec} ({self.split})" if self.origin else f"{self.spec!r} ({self.split})"
        )


def match_spec(spec: str, split: str, record: str) -> Interval | None:
    """The interval ``spec`` selects in ``record``, or None if it names another record.

    A spec equal to the record name takes the whole record (UCSC names such as ``chr13:755-760`` are whole
    records when a record has exactly that name); ``record:start-end`` is 1-based inclusive, like samtools.
    """
    if spec == record:
        return Interval(split, spec, record, 0, None)
    if not spec.startswith(record + ":"):
        return None
    coords = _COORDS.match(spec[len(record) + 1 :])
    if not coords:
        return None
    start, end = (int(value.replace(",", "")) for value in coords.groups())
    if start < 1 or end < start:
        raise DataError(f"region {spec!r}: start must be >= 1 and end >= start (1-based inclusive)")
    return Interval(split, spec, record, start - 1, end)


def static_interval(spec: str, split: str) -> Interval:
    """Best guess of a spec's interval before the FASTA is read (used for early overlap checks)."""
    name, _, coords = spec.rpartition(":")
    if name and _COORDS.match(coords):
        found = match_spec(spec, split, name)
        if found is not None:
            return found
    return Interval(split, spec, spec, 0, None)


def check_overlaps(intervals: list[Interval]) -> None:
    """Raise if any two intervals share bases (same record); names both specs and the fix."""
    ordered = sorted(intervals, key=lambda iv: (iv.record, iv.start))
    for left, right in itertools.pairwise(ordered):
        if left.record != right.record:
            continue
        if left.end is None or right.start < left.end:
            where = "both splits" if left.split != right.split else f"the {left.split} split twice"
            raise DataError(
                f"regions {left.describe()} and {right.describe()} share bases of {left.record}: the same "
                f"bases are in {where}; make train= and heldout= disjoint"
            )


def is_bed(spec: str) -> bool:
    """Whether a train=/heldout= item names a BED file (``.bed`` or ``.bed.gz``) rather than a region."""
    return spec.lower().endswith(BED_SUFFIXES)


@dataclass(frozen=True)
class BedFile:
    """The intervals of one BED file given for a split, and the file's MD5 (for the manifest)."""

    path: Path
    split: str
    intervals: list[Interval]
    md5: str


def read_bed(path: str | Path, split: str) -> BedFile:
    """Intervals of a BED file (plain or gzip): columns chrom, start, end (0-based half-open), more ignored.

    Blank lines and header lines (``#``, ``track``, ``browser``) are skipped. DataError naming the file and
    line for a line with fewer than 3 columns, coordinates that are not integers, start < 0 or end <= start;
    and for a missing file or one without intervals.
    """
    import gzip

    path = Path(path)
    flag = f"--{split}"
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{flag} {path}: cannot read the BED file ({err.strerror}); check the path") from err
    try:
        text = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise DataError(
            f"{path}: not a readable BED file ({err}); give a plain or gzip text BED file"
        ) from err
    intervals = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("\t") if "\t" in line else line.split()
        if not line.strip() or line.startswith("#") or fields[0] in _BED_HEADERS:
            continue
        origin = f"{path} line {number}"
        if len(fields) < 3:
            raise DataError(
                f"{origin}: {line.strip()!r} has {len(fields)} column(s); a BED line needs chrom, "
                "start and end separated by tabs"
            )
        chrom, start_text, end_text = (field.strip() for field in fields[:3])
        if not start_text.isdigit() or not end_text.isdigit():
            raise DataError(
                f"{origin}: start {start_text!r} and end {end_text!r} must be non-negative integers "
                "(BED is 0-based, half-open)"
            )
        start, end = int(start_text), int(end_text)
        if end <= start:
            raise DataError(
                f"{origin}: end {end:,} is not after start {start:,}; BED intervals are 0-based "
                "half-open, so end > start"
            )
        intervals.append(Interval(split, f"{chrom}:{start + 1}-{end}", chrom, start, end, origin))
    if not intervals:
        raise DataError(f"{flag} {path}: the BED file has no intervals; give chrom, start, end lines")
    return BedFile(path, split, intervals, hashlib.md5(data).hexdigest())
