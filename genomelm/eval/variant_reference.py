"""The reference `genomelm variants` reads its windows from: the run's source files (or `fasta=`), only the
stretches the variants need, with the soft-mask, as `genomelm data` reads a genome."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from genomelm.data import DataError, read_manifest
from genomelm.data.faidx import IndexedFasta, region_index
from genomelm.data.fasta import BLOCK_BYTES, INVALID_BYTE
from genomelm.data.streams import open_stream
from genomelm.data.vocab import (
    SCAN_BYTES,
)
from genomelm.eval.vcf import VariantError
from genomelm.run.config import TrainConfig


class RecordBases:
    """The parts of one reference record the windows read: merged intervals [start, end) (0-based), each as
    scan codes (uint8 [end - start]: base code, | SOFT_BIT where lower case), and the record's length
    (bases) once it has been read."""

    def __init__(self, intervals: Sequence[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(intervals):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.parts = [np.zeros(hi - lo, dtype=np.uint8) for lo, hi in merged]
        self.length = 0

    def feed(self, offset: int, scan: bytes) -> None:
        """Bases [offset, offset + len(scan)) of the record, as scan codes."""
        end = offset + len(scan)
        first = max(0, bisect.bisect_right(self.starts, offset) - 1)
        for start, part in zip(self.starts[first:], self.parts[first:]):
            if start >= end:
                break
            lo, hi = max(start, offset), min(start + len(part), end)
            if lo < hi:
                part[lo - start : hi - start] = np.frombuffer(scan, np.uint8, hi - lo, lo - offset)

    def finish(self, length: int) -> None:
        """The record has `length` bases: the parts end there."""
        self.length = length
        self.parts = [part[: max(0, length - start)] for start, part in zip(self.starts, self.parts)]

    def fetch(self, start: int, end: int) -> np.ndarray:
        """Scan codes of bases [start, end), clipped to the record's end; inside one of the intervals read."""
        end = min(end, self.length)
        if end <= start:
            return np.zeros(0, dtype=np.uint8)
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0 or end - self.starts[i] > len(self.parts[i]):
            raise AssertionError(f"bases [{start}, {end}) were not read")
        return self.parts[i][start - self.starts[i] : end - self.starts[i]]


def run_manifest(config: TrainConfig) -> dict:
    """The manifest of the run's prepared folder: its vocabulary (the model's token ids) and sources."""
    manifest = read_manifest(config.data_dir)
    if manifest is None:
        raise VariantError(
            f"{config.data_dir}: no prepared data (no manifest.json), so the model's token ids are unknown; "
            "prepare the run's data first (make data)"
        )
    return manifest


def reference_files(config: TrainConfig, manifest: dict) -> list[Path]:
    """`fasta=` (comma-separated files), or else the source files the run's data was prepared from (the
    manifest's `sources`); VariantError naming a missing file."""
    if config.variants.fasta:
        paths = [Path(item.strip()) for item in str(config.variants.fasta).split(",")]
        named = f"fasta={config.variants.fasta} names"
    else:
        paths = [Path(source["path"]) for source in manifest["sources"]]
        named = f"{config.data_dir / 'manifest.json'} names the run's reference"
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise VariantError(
            f"{named} {', '.join(missing)}, which is not there; give an existing reference file as fasta=FILE"
        )
    return paths


def invalid_base(path: Path, record: str, offset: int, at: int, char: str) -> DataError:
    """The data stage's error for a character that is no base, at `offset + at` (0-based) of `record`."""
    return DataError(
        f"{path}: record {record}, base {offset + at + 1:,} (1-based): invalid character {char!r}; only "
        "A C G T N, IUPAC codes R Y K M S W B D H V (either case) are allowed"
    )


def read_reference(
    paths: Sequence[Path], wanted: Callable[[str], list[tuple[int, int]] | None]
) -> tuple[dict[str, int], dict[str, RecordBases]]:
    """Every record's length (name -> bases, in file order) and the bases of the records `wanted(name)`
    gives intervals for (None: not read). FASTA (plain, gzip, BGZF), .2bit, GenBank and EMBL through the data
    stage's readers; a FASTA with an up-to-date samtools index only where the intervals lie."""
    lengths: dict[str, int] = {}
    bases: dict[str, RecordBases] = {}

    def begin(path: Path, name: str) -> RecordBases | None:
        if name in lengths:
            raise VariantError(
                f"{path}: record {name!r} is in the reference twice; record names must be unique"
            )
        intervals = wanted(name)
        if intervals is None:
            return None
        bases[name] = RecordBases(intervals)
        return bases[name]

    for path in paths:
        index, _ = region_index(path)
        if index is not None:
            fasta = IndexedFasta(path, index)
            try:
                for name, length in fasta.records():
                    record = begin(path, name)
                    lengths[name] = length
                    if record is None:
                        continue
                    record.finish(length)
                    for start, part in zip(record.starts, record.parts):
                        offset = start
                        for raw in fasta.bases(name, start, start + len(part), BLOCK_BYTES):
                            piece = raw.translate(SCAN_BYTES)
                            at = piece.find(INVALID_BYTE)
                            if at >= 0:
                                raise invalid_base(path, name, offset, at, chr(raw[at]))
                            record.feed(offset, piece)
                            offset += len(raw)
            finally:
                fasta.close()
            continue
        stream = open_stream(path, table=SCAN_BYTES)
        name, offset, record = "", 0, None
        for event in stream:
            if isinstance(event, str):
                if name:
                    lengths[name] = offset
                    if record is not None:
                        record.finish(offset)
                name, offset, record = event, 0, begin(path, event)
                continue
            if record is not None:
                if stream.invalid is not None:
                    raise invalid_base(path, name, offset, *stream.invalid)
                record.feed(offset, event)
            offset += len(event)
        if name:
            lengths[name] = offset
            if record is not None:
                record.finish(offset)
    return lengths, bases
