"""Streaming FASTA reader over plain, gzip and BGZF files (BGZF is valid multi-member gzip).

pyfaidx needs an index and cannot read plain gzip, which is what UCSC serves; one sequential pass over
decompressed bytes reads all three formats without an index or a decompressed copy in the cache.
Decompression uses ISA-L (``isal.igzip``, a drop-in for ``gzip``), about 3x faster than zlib.
"""

from __future__ import annotations

import hashlib
import io
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from isal import igzip, isal_zlib

from genomelm.data.errors import DataError
from genomelm.data.vocab import INVALID

BLOCK_BYTES = 8 << 20  # decompressed bytes per read
TWOBIT_MAGICS = (b"\x43\x27\x41\x1a", b"\x1a\x41\x27\x43")
_WHITESPACE = b" \t\r\n"
INVALID_BYTE = bytes([INVALID])  # what a ``table`` maps a byte to that must not be in a sequence


class _HashingReader(io.RawIOBase):
    """File wrapper that feeds every byte read through MD5, so checksumming costs no extra pass.

    A readable raw stream, so ``io.TextIOWrapper`` can decode it (GenBank and EMBL through Biopython).
    """

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self.raw = raw
        self.md5 = hashlib.md5()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.md5.update(data)
        self.count += len(data)
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        count = self.raw.readinto(buffer)
        self.md5.update(memoryview(buffer)[:count])
        self.count += count
        return count

    def close(self) -> None:
        self.raw.close()
        super().close()


def detect_format(path: Path) -> str:
    """'gzip' (plain gzip or BGZF), '2bit' or 'plain'; raises DataError for empty, byte-swapped .2bit and
    missing files."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise DataError(f"{path}: cannot open FASTA ({err.strerror}); check the path") from err
    if not magic:
        raise DataError(f"{path}: file is empty; give a FASTA file with at least one '>' record")
    if magic == TWOBIT_MAGICS[0]:
        return "2bit"
    if magic == TWOBIT_MAGICS[1]:
        raise DataError(
            f"{path}: big-endian .2bit is not supported (py2bit reads little-endian only); convert it first "
            f"with `twoBitToFa {path} out.fa`"
        )
    return "gzip" if magic[:2] == b"\x1f\x8b" else "plain"


def detect_records_format(path: Path) -> str:
    """'genbank', 'embl' or 'fasta', from the first non-blank line of the (decompressed) text: GenBank
    files begin with a LOCUS line and EMBL files with an ID line, whatever the file is called."""
    compressed = detect_format(path) == "gzip"
    try:
        with igzip.open(path, "rb") if compressed else open(path, "rb") as handle:
            head = handle.read(1 << 16)
    except (EOFError, OSError, isal_zlib.error):
        return "fasta"  # the FASTA reader reports the broken file, naming it
    first = next((line for line in head.splitlines() if line.strip()), b"")
    if first.startswith(b"LOCUS "):
        return "genbank"
    if first.startswith(b"ID   "):
        return "embl"
    return "fasta"


class FastaStream:
    """Iterate a FASTA file as events: ``str`` (a new record's name) then ``bytes`` (its next bases).

    Bases come without line breaks, in blocks of up to ``BLOCK_BYTES``; with ``table`` (a 256-byte
    ``bytes.translate`` table) they come mapped through it, in the same pass that drops the line breaks, and
    ``invalid`` is None or, if the table maps a byte of the last piece to ``INVALID_BYTE``, the first such
    (index in the piece, character in the file). A background thread reads, decompresses
    (ISA-L releases the GIL), parses and translates, a few blocks ahead of the caller, so all of that
    overlaps with the caller's work. ``md5`` (hex of the file as stored on disk) is set after iteration.
    """

    def __init__(self, path: str | Path, block_bytes: int = BLOCK_BYTES, table: bytes | None = None) -> None:
        self.path = Path(path)
        self.format = detect_format(self.path)
        self.block_bytes = block_bytes
        self.table = table
        self.invalid: tuple[int, str] | None = None
        self.md5: str | None = None
        self._hasher: _HashingReader | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes of the file (as stored) read so far (by the reader thread, so a little ahead)."""
        return self._hasher.count if self._hasher else 0

    def __iter__(self) -> Iterator[str | bytes]:
        """Events made by a reader thread, handed over through a small bounded queue."""
        events: queue.Queue = queue.Queue(maxsize=3)
        stop = threading.Event()
        self._hasher = _HashingReader(open(self.path, "rb"))  # noqa: SIM115 - closed by the reader thread
        hasher = self._hasher

        def produce() -> None:
            try:
                for event in self._events(hasher):
                    events.put(event)
                    if stop.is_set():
                        return
                self.md5 = hasher.md5.hexdigest()
                events.put(None)
            except (DataError, EOFError, OSError, isal_zlib.error) as err:
                events.put(err)
            except Exception as err:  # noqa: BLE001 - hand anything else over, or the consumer waits forever
                events.put(RuntimeError(f"reading {self.path} failed: {err!r}"))
            finally:
                hasher.close()

        thread = threading.Thread(target=produce, name=f"read {self.path.name}", daemon=True)
        thread.start()
        try:
            while True:
                item = events.get()
                if item is None:
                    return
                if isinstance(item, (DataError, RuntimeError)):
                    raise item
                if isinstance(item, BaseException):
                    raise DataError(
                        f"{self.path}: truncated or corrupt gzip ({item}); re-download or re-compress the "
                        "file (a cached download can simply be deleted)"
                    ) from item
                event, self.invalid = item
                yield event
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    events.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    def _blocks(self, hasher: _HashingReader) -> Iterator[bytes]:
        stream: BinaryIO = igzip.GzipFile(fileobj=hasher, mode="rb") if self.format == "gzip" else hasher
        while block := stream.read(self.block_bytes):
            yield block

    def _events(self, hasher: _HashingReader) -> Iterator[tuple[str | bytes, tuple[int, str] | None]]:
        """(event, first invalid base of a piece); runs in the reader thread."""
        names: set[str] = set()
        header = bytearray()
        in_header = False
        at_line_start = True
        seen_record = False
        for block in self._blocks(hasher):
            pos = 0
            while pos < len(block):
                if in_header:
                    newline = block.find(b"\n", pos)
                    header += block[pos : len(block) if newline < 0 else newline]
                    if newline < 0:
                        break
                    pos, in_header, at_line_start = newline + 1, False, True
                    name = self._record_name(header, names)
                    names.add(name)
                    yield name, None
                    continue
                gt = block.find(b">", pos)
                end = len(block) if gt < 0 else gt
                if end > pos:
                    piece = block[pos:end].translate(self.table, _WHITESPACE)
                    if piece:
                        if not seen_record:
                            raise DataError(
                                f"{self.path}: not a FASTA file (no '>' header before the first sequence "
                                "line); give a FASTA, GenBank, EMBL or .2bit file"
                            )
                        yield piece, self._first_invalid(piece, block, pos, end)
                    at_line_start = block[end - 1] == 0x0A
                if gt < 0:
                    break
                if not at_line_start:
                    raise DataError(
                        f"{self.path}: stray '>' inside a sequence line of record {header_name(header)!r}; "
                        "fix the file (a '>' may only start a header line)"
                    )
                header.clear()
                in_header, seen_record, pos = True, True, gt + 1
        if in_header:  # header on the last line without a trailing newline
            yield self._record_name(header, names), None
        if not seen_record:
            raise DataError(
                f"{self.path}: not a FASTA file (no '>' header found); "
                "give a FASTA, GenBank, EMBL or .2bit file"
            )

    def _first_invalid(self, piece: bytes, block: bytes, pos: int, end: int) -> tuple[int, str] | None:
        if self.table is None:
            return None
        at = piece.find(INVALID_BYTE)  # memchr: far cheaper than a numpy pass over the piece
        if at < 0:
            return None
        return at, chr(block[pos:end].translate(None, _WHITESPACE)[at])

    def _first_invalid_unwrapped(self, piece: bytes, raw: bytes) -> tuple[int, str] | None:
        """As ``_first_invalid`` for a piece translated from ``raw`` without dropping any byte (no line
        breaks)."""
        if self.table is None:
            return None
        at = piece.find(INVALID_BYTE)
        return None if at < 0 else (at, chr(raw[at]))

    def _record_name(self, header: bytearray, names: set[str]) -> str:
        name = header_name(header)
        if not name:
            raise DataError(f"{self.path}: a header line has no record name after '>'; name every record")
        if name in names:
            raise DataError(f"{self.path}: duplicate record name {name!r}; record names must be unique")
        return name


def header_name(header: bytes | bytearray) -> str:
    """Record name: the header text up to the first whitespace."""
    parts = bytes(header).split(maxsplit=1)
    return parts[0].decode("ascii", errors="replace") if parts else ""
