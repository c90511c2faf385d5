"""Streaming reader for UCSC ``.2bit`` files, through py2bit (deeptools' lib2bit), with FastaStream's events.

A ``.2bit`` file gives the same events (and so the same prepared dataset) as the FASTA that ``twoBitToFa``
writes from it: records in index order, N blocks as N, soft-masked blocks in lower case, N inside a
soft-masked block as 'n' (lib2bit leaves those upper case; twoBitToFa and the FASTA they came from do not).
Only A C G T N survive ``faToTwoBit``, so IUPAC codes of the original FASTA are N here.

lib2bit memory-maps the file and reads it without bounds checks, so a truncated or corrupt file could crash
the process or give wrong bases silently; the header, the index and every record's block lists are
therefore checked here first, in Python, against the file size.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from genomelm.data.errors import DataError
from genomelm.data.fasta import BLOCK_BYTES, FastaStream, _HashingReader, header_name

SIGNATURE = 0x1A412743
_RE_DOWNLOAD = "re-download or re-create it (a cached download can simply be deleted)"


@dataclass
class TwoBitRecord:
    """One record of the index: its name, size and where its packed bases lie in the file."""

    name: str  # as a FASTA header would give it (see header_name)
    query: str  # as py2bit looks it up
    size: int
    data_offset: int
    data_end: int
    # [start, end) ranges that are N and soft-masked, so 'n' (sorted, not overlapping)
    lower_n: list[tuple[int, int]] = field(default_factory=list)


def read_index(path: Path) -> list[TwoBitRecord]:
    """Parse and check the header, index and per-record block lists of a version-0 little-endian .2bit."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header = _read(handle, path, 16, "the header")
        signature, version, count, _reserved = struct.unpack("<4I", header)
        if signature != SIGNATURE:
            raise DataError(
                f"{path}: not a little-endian .2bit file; convert it with `twoBitToFa {path} out.fa`"
            )
        if version != 0:
            raise DataError(
                f"{path}: .2bit version {version} (64-bit offsets) is not supported by py2bit; convert it "
                f"with `twoBitToFa {path} out.fa`"
            )
        if count == 0:
            raise DataError(f"{path}: .2bit file has no records; give a genome with at least one sequence")
        index = []
        for _ in range(count):
            (length,) = _read(handle, path, 1, "the index")
            raw = _read(handle, path, length, "the index")
            (offset,) = struct.unpack("<I", _read(handle, path, 4, "the index"))
            index.append((raw, offset))
        records: list[TwoBitRecord] = []
        names: set[str] = set()
        for raw, offset in index:
            record = _read_record(handle, path, size, raw, offset)
            if record.name in names:
                raise DataError(f"{path}: duplicate record name {record.name!r}; record names must be unique")
            names.add(record.name)
            records.append(record)
    return records


def _read(handle: BinaryIO, path: Path, count: int, what: str) -> bytes:
    data = handle.read(count)
    if len(data) != count:
        raise DataError(f"{path}: truncated or corrupt .2bit (file ends inside {what}); {_RE_DOWNLOAD}")
    return data


def _blocks(handle: BinaryIO, path: Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A block list: count, then that many starts, then that many sizes (uint32 each), as int64 arrays."""
    (count,) = struct.unpack("<I", _read(handle, path, 4, what))
    values = np.frombuffer(_read(handle, path, 8 * count, what), dtype="<u4").astype(np.int64)
    return values[:count], values[count:]


def _read_record(handle: BinaryIO, path: Path, file_size: int, raw: bytes, offset: int) -> TwoBitRecord:
    name = header_name(raw)
    if not name:
        raise DataError(f"{path}: a record of the .2bit index has no name; {_RE_DOWNLOAD}")
    try:
        query = raw.decode("utf-8")
    except UnicodeDecodeError:
        query = "\0"
    if "\0" in query:
        raise DataError(f"{path}: record name {name!r} is not readable text; {_RE_DOWNLOAD}")
    what = f"record {name!r}"
    if offset >= file_size:
        raise DataError(
            f"{path}: truncated or corrupt .2bit ({what} starts at byte {offset:,} but the file has "
            f"{file_size:,} bytes); {_RE_DOWNLOAD}"
        )
    handle.seek(offset)
    (dna_size,) = struct.unpack("<I", _read(handle, path, 4, what))
    n_starts, n_sizes = _blocks(handle, path, what)
    mask_starts, mask_sizes = _blocks(handle, path, what)
    _read(handle, path, 4, what)  # reserved
    for kind, starts, sizes in (("N", n_starts, n_sizes), ("soft-mask", mask_starts, mask_sizes)):
        if len(starts) and (np.any(np.diff(starts) < 0) or np.any(starts + sizes > dna_size)):
            raise DataError(
                f"{path}: corrupt .2bit ({kind} blocks of {what} are unsorted or run past its "
                f"{dna_size:,} bases); {_RE_DOWNLOAD}"
            )
    data_offset = handle.tell()
    data_end = data_offset + (dna_size + 3) // 4
    if data_end > file_size:
        raise DataError(
            f"{path}: truncated or corrupt .2bit ({what} needs bytes up to {data_end:,} but the file has "
            f"{file_size:,}); {_RE_DOWNLOAD}"
        )
    lower_n = _intersect(n_starts, n_starts + n_sizes, mask_starts, mask_starts + mask_sizes)
    return TwoBitRecord(name, query, dna_size, data_offset, data_end, lower_n)


def _intersect(n_starts: np.ndarray, n_ends: np.ndarray, m_starts: np.ndarray, m_ends: np.ndarray) -> list:
    """[start, end) ranges inside both an N block and a soft-mask block (blocks sorted by start)."""
    if not len(n_starts) or not len(m_starts):
        return []
    reach = np.maximum.accumulate(m_ends)  # masks before the first index with reach > s all end by s
    out = []
    for s, e in zip(n_starts.tolist(), n_ends.tolist()):
        first = int(np.searchsorted(reach, s, side="right"))
        last = int(np.searchsorted(m_starts, e, side="left"))
        for lo, hi in zip(m_starts[first:last].tolist(), m_ends[first:last].tolist()):
            lo, hi = max(lo, s), min(hi, e)
            if lo < hi:
                out.append((lo, hi))
    out.sort()
    return out


class TwoBitStream(FastaStream):
    """Events of a .2bit file as :class:`FastaStream` gives them for the equivalent FASTA.

    Each record's bases come from py2bit in pieces of ``block_bytes`` bases (never a whole chromosome),
    mapped through ``table`` like FastaStream's. The file is hashed as the records are read, in file order,
    so ``bytes_read`` tracks progress and ``md5`` (of the .2bit itself) is set after iteration.
    """

    def __init__(self, path: str | Path, block_bytes: int = BLOCK_BYTES, table: bytes | None = None) -> None:
        super().__init__(path, block_bytes, table)
        if self.format != "2bit":
            raise DataError(f"{self.path}: not a .2bit file")

    def _events(self, hasher: _HashingReader) -> Iterator[tuple[str | bytes, tuple[int, str] | None]]:
        try:
            yield from self._twobit_events(hasher)
        except DataError:
            raise
        except Exception as err:  # py2bit raises RuntimeError (read_index's checks should prevent it); any
            # error must reach the caller as a DataError, or FastaStream's reader thread would die silently
            raise DataError(f"{self.path}: cannot read .2bit ({err}); {_RE_DOWNLOAD}") from err

    def _twobit_events(self, hasher: _HashingReader) -> Iterator[tuple[str | bytes, tuple[int, str] | None]]:
        import py2bit  # C extension; imported here so FASTA-only use never needs it

        records = read_index(self.path)
        tb = py2bit.open(str(self.path), True)  # True: keep the soft-mask (lower case)
        try:
            for record in records:
                yield record.name, None
                for start in range(0, record.size, self.block_bytes):
                    end = min(start + self.block_bytes, record.size)
                    raw = tb.sequence(record.query, start, end).encode("ascii")
                    if len(raw) != end - start:
                        raise DataError(
                            f"{self.path}: py2bit gave {len(raw):,} bases for "
                            f"{record.name}:{start + 1}-{end}; {_RE_DOWNLOAD}"
                        )
                    raw = _lower_n(raw, record.lower_n, start, end)
                    piece = raw.translate(self.table) if self.table is not None else raw
                    self._hash_to(hasher, record.data_offset + (end + 3) // 4)
                    yield piece, self._first_invalid_unwrapped(piece, raw)
            while hasher.read(self.block_bytes):  # the rest of the file, for the md5
                pass
        finally:
            tb.close()

    def _hash_to(self, hasher: _HashingReader, position: int) -> None:
        while hasher.count < position:
            if not hasher.read(min(self.block_bytes, position - hasher.count)):
                raise DataError(f"{self.path}: the file shrank while it was read; {_RE_DOWNLOAD}")


def _lower_n(raw: bytes, lower_n: list[tuple[int, int]], start: int, end: int) -> bytes:
    """``raw`` (bases [start, end)) with the N of soft-masked N ranges made 'n', as twoBitToFa writes them."""
    buf = None
    for lo, hi in lower_n:  # few: N runs inside repeats; usually none
        if hi <= start:
            continue
        if lo >= end:
            break
        lo, hi = max(lo, start), min(hi, end)
        if buf is None:
            buf = bytearray(raw)
        buf[lo - start : hi - start] = b"n" * (hi - lo)
    return raw if buf is None else bytes(buf)
