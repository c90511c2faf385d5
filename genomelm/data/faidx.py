"""Reading only the selected regions of an indexed FASTA (plain or BGZF) through pyfaidx.

A FASTA with an up-to-date samtools index (``x.fa.fai``; for BGZF also ``x.fa.gz.gzi``, as ``samtools faidx``
writes them) is read region by region, seeking past everything else, so a BED file of a few regions of a
large genome never decompresses the rest. Plain gzip cannot seek and is streamed whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from genomelm.data.errors import DataError
from genomelm.data.fasta import detect_format, detect_records_format

# pyfaidx picks its BGZF reader by the file name
_BGZF_NAMES = (".gz", ".bgz")


def is_bgzf(path: Path) -> bool:
    """Whether ``path`` starts with a BGZF block: a gzip member whose extra field has the 'BC' subfield."""
    with open(path, "rb") as handle:
        head = handle.read(16)
    return len(head) == 16 and head[:4] == b"\x1f\x8b\x08\x04" and head[12:14] == b"BC"


def region_index(path: Path) -> tuple[Path | None, str]:
    """(the .fai through which pyfaidx can read regions of ``path``, '') or (None, why not)."""
    fmt = detect_format(path)
    if fmt == "2bit" or detect_records_format(path) != "fasta":
        return None, "only FASTA is read through an index"
    if fmt == "gzip" and not is_bgzf(path):
        return (
            None,
            (
                "plain gzip cannot be read in parts; recompress it with `bgzip` and index it with "
                "`samtools faidx`"
            ),
        )
    if fmt == "gzip" and not path.name.lower().endswith(_BGZF_NAMES):
        return None, "a BGZF file needs a name ending .gz or .bgz to be read through its index"
    needed = [path.with_name(path.name + ".fai")] + (
        [path.with_name(path.name + ".gzi")] if fmt == "gzip" else []
    )
    stamp = path.stat().st_mtime_ns
    for index in needed:
        if not index.is_file():
            return None, f"no index {index.name}; make it with `samtools faidx {path}`"
        if index.stat().st_mtime_ns < stamp:
            return (
                None,
                f"its index {index.name} is older than the file; rebuild it with `samtools faidx {path}`",
            )
    return needed[0], ""


class IndexedFasta:
    """Records and bases of an indexed FASTA, read through pyfaidx without touching the rest of the file."""

    def __init__(self, path: Path, index: Path) -> None:
        import pyfaidx  # only needed for indexed reads

        self.path, self.index = path, index
        self._errors = (pyfaidx.FastaIndexingError, pyfaidx.FetchError, ValueError, OSError)
        try:
            self.fasta = pyfaidx.Fasta(str(path), as_raw=True, build_index=False, rebuild=False)
        except self._errors as err:
            raise self._error(err) from err

    def _error(self, err: Exception) -> DataError:
        return DataError(
            f"{self.path}: cannot read it through its index {self.index} ({err}); delete the index "
            f"or rebuild it with `samtools faidx {self.path}`"
        )

    def records(self) -> list[tuple[str, int]]:
        """(name, length) of every record, in file order."""
        return [(name, entry.rlen) for name, entry in self.fasta.faidx.index.items()]

    def bases(self, record: str, start: int, end: int, block: int) -> Iterator[bytes]:
        """Bases [start, end) (0-based half-open) of ``record`` as they are in the file, ``block`` at a
        time."""
        for lo in range(start, end, block):
            hi = min(lo + block, end)
            try:
                text = self.fasta.get_seq(record, lo + 1, hi)
            except self._errors as err:
                raise self._error(err) from err
            if len(text) != hi - lo:
                raise self._error(ValueError(f"{record}:{lo + 1}-{hi} gave {len(text):,} bases"))
            yield text.encode("latin-1")

    def close(self) -> None:
        self.fasta.close()
