"""One reader for every genome file `genomelm data` takes: `open_stream(path)` gives the same events (a
record's name, then its bases) for FASTA (plain, gzip, BGZF), .2bit, GenBank and EMBL, choosing the reader by
the file's bytes, not its name."""

from __future__ import annotations

from pathlib import Path

from genomelm.data.fasta import BLOCK_BYTES, FastaStream, detect_format, detect_records_format
from genomelm.data.flatfile import FlatFileStream
from genomelm.data.twobit import TwoBitStream


def open_stream(path: str | Path, block_bytes: int = BLOCK_BYTES, table: bytes | None = None) -> FastaStream:
    """Events of a genome file: a :class:`FastaStream`, or with the same events a ``TwoBitStream`` for .2bit
    and a ``FlatFileStream`` for GenBank and EMBL (plain or gzip)."""
    path = Path(path)
    if detect_format(path) == "2bit":
        return TwoBitStream(path, block_bytes, table)
    records_format = detect_records_format(path)
    if records_format != "fasta":
        return FlatFileStream(path, records_format, block_bytes, table)
    return FastaStream(path, block_bytes, table)
