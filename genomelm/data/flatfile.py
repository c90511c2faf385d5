"""GenBank and EMBL input (plain or gzip), parsed by Biopython's ``SeqIO``, with FastaStream's events.

Records are named by their accession.version (``SeqRecord.id``, as NCBI's FASTA headers name them), or by
the LOCUS / ID name when there is none. Both formats write the sequence in lower case by convention and
Biopython reads it in upper case, so letter case is no soft-mask here: no base comes out soft-masked (a
FASTA of the same genome keeps its soft-mask). ``SeqIO`` parses a record at a time, so one record's
sequence is held in memory while it is cut into windows.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from isal import igzip, isal_zlib

from genomelm.data.errors import DataError
from genomelm.data.fasta import BLOCK_BYTES, FastaStream, _HashingReader

if TYPE_CHECKING:
    from Bio.SeqRecord import SeqRecord

FORMAT_NAMES = {"genbank": "GenBank", "embl": "EMBL"}
# Biopython only warns when a record's sequence is cut short or disagrees with the length in its header line
_INCOMPLETE = ("Premature end of file", "Expected sequence length")


class FlatFileStream(FastaStream):
    """Events of a GenBank or EMBL file as :class:`FastaStream` gives them for the same records in FASTA.

    ``format`` is 'genbank' or 'embl' and ``compression`` 'gzip' or 'plain'; ``md5`` is of the file as stored.
    """

    def __init__(
        self,
        path: str | Path,
        records_format: str,
        block_bytes: int = BLOCK_BYTES,
        table: bytes | None = None,
    ) -> None:
        super().__init__(path, block_bytes, table)
        if records_format not in FORMAT_NAMES:
            raise ValueError(
                f"records_format must be one of {', '.join(FORMAT_NAMES)}, not {records_format!r}"
            )
        self.compression = self.format  # detect_format's 'gzip' or 'plain'
        self.format = records_format

    def _events(self, hasher: _HashingReader) -> Iterator[tuple[str | bytes, tuple[int, str] | None]]:
        from Bio import SeqIO  # ~0.1 s; only needed for these formats
        from Bio.Seq import UndefinedSequenceError

        kind = FORMAT_NAMES[self.format]
        binary = igzip.GzipFile(fileobj=hasher, mode="rb") if self.compression == "gzip" else hasher
        text = io.TextIOWrapper(
            binary, encoding="latin-1"
        )  # any byte decodes; bad letters are reported below
        names: set[str] = set()
        last = None
        try:
            records = SeqIO.parse(text, self.format)
            while (record := self._next_record(records, kind, last)) is not None:
                name = record.id if record.id not in ("", "<unknown id>") else record.name
                if name in names:
                    raise DataError(
                        f"{self.path}: duplicate record name {name!r}; record names must be unique"
                    )
                names.add(name)
                last = name
                if "protein" in str(record.annotations.get("molecule_type", "")).lower():
                    raise DataError(f"{self.path}: record {name} is a protein sequence; give DNA records")
                try:
                    bases = bytes(record.seq)
                except UndefinedSequenceError:
                    raise DataError(
                        f"{self.path}: record {name} has a length but no sequence (a CONTIG or WGS master "
                        f"record); download the {kind} file with its sequence (e.g. NCBI's 'GenBank (full)')"
                    ) from None
                yield name, None
                for start in range(0, len(bases), self.block_bytes):
                    raw = bases[start : start + self.block_bytes]
                    piece = raw.translate(self.table) if self.table is not None else raw
                    yield piece, self._first_invalid_unwrapped(piece, raw)
        except (DataError, EOFError, isal_zlib.error):
            raise  # a broken gzip is reported as such by FastaStream
        except Exception as err:  # Biopython raises ValueError and others for a malformed file
            where = f" after record {last}" if last else ""
            raise DataError(
                f"{self.path}: cannot read it as {kind}{where} ({err}); check that the file is complete and "
                f"valid {kind}"
            ) from err
        if not names:
            raise DataError(
                f"{self.path}: no {kind} records found; give a {kind} file with at least one record"
            )
        while hasher.read(self.block_bytes):  # anything after the last record, for the md5
            pass

    def _next_record(self, records: Iterator[SeqRecord], kind: str, last: str | None) -> SeqRecord | None:
        """The next SeqRecord of ``records`` (None at the end); DataError for a truncated or inconsistent
        one."""
        from Bio import BiopythonParserWarning

        # runs in the reader thread: warnings caught here from other threads are re-issued below, not lost
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BiopythonParserWarning)
            record = next(records, None)
        for warning in caught:
            message = str(warning.message)
            if message.startswith(_INCOMPLETE):
                where = (
                    f"record {record.id}"
                    if record is not None
                    else f"the record after {last or 'the header'}"
                )
                raise DataError(
                    f"{self.path}: {where}: {message.rstrip('.')}; the {kind} file is truncated or "
                    "damaged, download it again"
                )
            warnings.warn_explicit(message, warning.category, warning.filename, warning.lineno)
        return record
