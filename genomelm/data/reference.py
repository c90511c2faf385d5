"""The reference a prepared folder was made from, read again: its records' lengths and chosen bases.

`source_files(folder, manifest)` checks that each source file the manifest names is still there as it was
(same size); `read_reference(paths, wanted)` reads every record's length and the wanted bases as scan codes
(`genomelm.data.vocab.SCAN_BYTES`: base code plus the soft-mask bit). What the read-outs (`genomelm track`,
`genomelm embed`) read a region of the genome with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from genomelm.data.streams import open_stream

from .errors import DataError
from .faidx import IndexedFasta, region_index
from .fasta import BLOCK_BYTES, detect_format
from .twobit import read_index
from .vocab import INVALID, SCAN_BYTES


def read_reference(
    paths: Sequence[Path], wanted: dict[str, list[tuple[int, int]]]
) -> tuple[dict[str, int], dict[tuple[str, int], np.ndarray]]:
    """Every record's length, in file order over `paths`, and the scan codes (uint8) of the `wanted` bases
    (record -> [(first, end)], 0-based half-open), by (record, first). A file with a samtools index is read
    only where wanted, a .2bit without wanted records only for its index; anything else is streamed once."""
    sizes: dict[str, int] = {}
    bases: dict[tuple[str, int], np.ndarray] = {}
    for path in paths:
        index, _ = region_index(path)
        if index is not None:
            fasta = IndexedFasta(path, index)
            try:
                for record, length in fasta.records():
                    sizes[record] = length
                    for first, end in wanted.get(record, []):
                        raw = b"".join(fasta.bases(record, first, min(end, length), BLOCK_BYTES))
                        bases[record, first] = _scan(path, record, first, raw.translate(SCAN_BYTES))
            finally:
                fasta.close()
            continue
        if detect_format(path) == "2bit":
            records = [(r.name, r.size) for r in read_index(path)]
            if not any(name in wanted for name, _ in records):
                sizes.update(records)
                continue
        parts: dict[tuple[str, int], list[bytes]] = {}
        record, offset, spans = "", 0, []
        for event in open_stream(path, table=SCAN_BYTES):
            if isinstance(event, str):
                if record:
                    sizes[record] = offset
                record, offset, spans = event, 0, wanted.get(event, [])
                continue
            end = offset + len(event)
            for first, last in spans:
                lo, hi = max(first, offset), min(last, end)
                if lo < hi:
                    parts.setdefault((record, first), []).append(event[lo - offset : hi - offset])
            offset = end
        if record:
            sizes[record] = offset
        for (name, first), pieces in parts.items():
            bases[name, first] = _scan(path, name, first, b"".join(pieces))
    return sizes, bases


def _scan(path: Path, record: str, first: int, scan: bytes) -> np.ndarray:
    """`scan` as uint8; DataError naming the file, record and base for a character that is no base."""
    codes = np.frombuffer(scan, dtype=np.uint8)
    bad = np.flatnonzero(codes == INVALID)
    if len(bad):
        raise DataError(
            f"{path}: record {record}, base {first + int(bad[0]) + 1:,} (1-based) is no base letter; only "
            "A C G T N and the IUPAC codes R Y K M S W B D H V (either case) are allowed: fix the file"
        )
    return codes


def source_files(folder: Path, manifest: dict) -> list[Path]:
    """The source files of the prepared `folder` (its `manifest`), each as it was when the data was prepared
    (same size); DataError naming the file and the fix otherwise."""
    paths = []
    for entry in manifest["sources"]:
        path = Path(entry["path"])
        if not path.is_file():
            raise DataError(
                f"{path}: the source reference of {folder} is missing; the read-outs read the record lengths "
                "(and a region's bases) from it: put it back there, or prepare the data again from where it "
                f"is now ({manifest['command']} force=true, with fasta= changed)"
            )
        if path.stat().st_size != entry["bytes"]:
            raise DataError(
                f"{path}: {path.stat().st_size:,} bytes, not the {entry['bytes']:,} it had when {folder} was "
                f"prepared from it; prepare the data again ({manifest['command']} force=true)"
            )
        paths.append(path)
    return paths
