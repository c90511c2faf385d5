"""Split specifications (record names or samtools-style ``name:start-end``) and SEQ sizes."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from genomelm.data.errors import DataError

_SEQ_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}
_COORDS = re.compile(r"^([0-9,]+)-([0-9,]+)$")


def parse_seq(text: str | int) -> int:
    """'16k' -> 16384, '512k' -> 524288, '1M' -> 1048576, '4096' -> 4096 (tokens)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not match or int(match.group(1)) <= 0:
        raise DataError(f"--seq {text!r}: give a positive token count such as 16k, 512k, 1M or 4096")
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
                f"regions {left.spec!r} ({left.split}) and {right.spec!r} ({right.split}) share bases of "
                f"{left.record}: the same bases are in {where}; make --train and --heldout disjoint"
            )
