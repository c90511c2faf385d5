"""Build the prepared dataset: FASTA -> uint8 code windows (megatron indexed dataset) + soft-mask + manifest.

Layout of the output folder (built in a hidden temp folder beside it and renamed into place last)::

    <split>.bin / <split>.idx                    codes, one document per window (megatron-core format)
    <split>.softmask.bin / <split>.softmask.idx  1 where the base was lower case, same layout
    manifest.json                                written last; its presence marks a complete folder

The manifest's ``checksums`` record every .bin/.idx file's size and the xxh3-128 digest of each 64 MiB block
of it, hashed as it is written; readers and the up-to-date check verify them (`genomelm.data.integrity`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from genomelm.data.config import DataConfig
from genomelm.data.download import check_md5, expected_md5, fetch, md5_of
from genomelm.data.errors import DataError
from genomelm.data.faidx import IndexedFasta, region_index
from genomelm.data.fasta import BLOCK_BYTES, INVALID_BYTE, detect_format
from genomelm.data.indexed import IndexedWriter
from genomelm.data.integrity import (
    FORMAT_VERSION,
    HASH,
    HASH_BLOCK_BYTES,
    MANIFEST,
    SPLITS,
    BlockHasher,
    DamagedFolder,
    FolderCheck,
    holds_only_prepared_files,
    load_manifest,
)
from genomelm.data.regions import (
    BedFile,
    Interval,
    check_overlaps,
    is_bed,
    match_spec,
    read_bed,
    static_interval,
)
from genomelm.data.streams import open_stream
from genomelm.data.vocab import (
    BUILTIN,
    CODE_MASK,
    IUPAC_BIT,
    SCAN_BYTES,
    SOFT_BIT,
    N,
    Vocabulary,
    tokenizer_vocabulary,
)
from genomelm.data.windows import CutWindow, WindowCutter


class _SplitWriter:
    """Writes one split's windows as they come and keeps their coordinates and counts."""

    def __init__(self, folder: Path, split: str, seq: int, max_n: float) -> None:
        self.folder, self.split, self.seq, self.max_n = folder, split, seq, max_n
        hasher = functools.partial(BlockHasher, HASH_BLOCK_BYTES)
        self.tokens = IndexedWriter(folder / f"{split}.bin", hasher=hasher)
        self.softmask = IndexedWriter(folder / f"{split}.softmask.bin", hasher=hasher)
        self.files: dict[str, dict] = {}  # file name -> size and block digests, once finalized
        self.columns: dict[str, list[int]] = {k: [] for k in ("record", "start", "end", "n", "softmasked")}
        self.records: list[str] = []
        self.regions: list[dict] = []
        self.stats = dict.fromkeys(
            (
                "bases",
                "n",
                "iupac_as_n",
                "softmasked",
                "windows",
                "window_bases",
                "window_n",
                "window_softmasked",
                "dropped_n_windows",
                "dropped_tail_bases",
                "padded_short",
            ),
            0,
        )

    def add(self, record: str, window: CutWindow) -> None:
        n_count = int(np.count_nonzero(window.codes == N))
        if n_count > self.max_n * window.length:
            self.stats["dropped_n_windows"] += 1
            return
        soft = int(np.count_nonzero(window.mask))
        self.tokens.add(window.codes)
        self.softmask.add(window.mask)
        if not self.records or self.records[-1] != record:
            self.records.append(record)
        for key, value in zip(
            self.columns, (len(self.records) - 1, window.start, window.start + window.length, n_count, soft)
        ):
            self.columns[key].append(value)
        self.stats["windows"] += 1
        self.stats["window_bases"] += window.length
        self.stats["window_n"] += n_count
        self.stats["window_softmasked"] += soft

    def finalize(self) -> dict:
        self.files.update(self.tokens.finalize(str(self.folder / f"{self.split}.idx")))
        self.files.update(self.softmask.finalize(str(self.folder / f"{self.split}.softmask.idx")))
        return {
            "prefix": self.split,
            "softmask_prefix": f"{self.split}.softmask",
            "regions": self.regions,
            "stats": self.stats,
            "windows": {"records": self.records, **self.columns},
        }


class _Region:
    """One interval of a record being cut into windows for one split."""

    def __init__(self, interval: Interval, writer: _SplitWriter, seq: int, stride: int) -> None:
        self.interval, self.writer = interval, writer
        self.cutter = WindowCutter(interval.start, seq, stride)

    def feed(self, codes: np.ndarray, mask: np.ndarray, scan: np.ndarray) -> None:
        stats = self.writer.stats
        n_count = int(np.count_nonzero(codes == N))
        stats["bases"] += len(codes)
        stats["n"] += n_count
        if n_count:  # IUPAC codes are read as N, so there are none where there is no N
            stats["iupac_as_n"] += int(np.count_nonzero(scan & IUPAC_BIT))
        stats["softmasked"] += int(np.count_nonzero(mask))
        for window in self.cutter.feed(codes, mask):
            self.writer.add(self.interval.record, window)


def _complement(record: str, held: list[Interval]) -> list[Interval]:
    """Train intervals covering the parts of ``record`` that no held-out interval covers."""
    pieces, start = [], 0
    for iv in sorted(held, key=lambda iv: iv.start):
        if iv.start > start:
            pieces.append(Interval("train", f"{record}:{start + 1}-{iv.start}", record, start, iv.start))
        if iv.end is None:
            return pieces
        start = iv.end
    spec = record if start == 0 else f"{record}:{start + 1}-"
    return [*pieces, Interval("train", spec, record, start, None)]


@dataclass
class _Selection:
    """What train= and heldout= select: record names and region strings, matched to records as they are
    read, and the intervals of BED files, whose records are known."""

    specs: list[tuple[str, str]]  # (split, record name or name:start-end)
    bed_files: list[BedFile]

    @property
    def bed_intervals(self) -> list[Interval]:
        return [iv for bed in self.bed_files for iv in bed.intervals]


def _selection(cfg: DataConfig) -> _Selection:
    """Split items as given; an item ending .bed or .bed.gz is a BED file, read (and checked) here."""
    specs, beds = [], []
    for split in SPLITS:
        for item in getattr(cfg, split):
            if is_bed(item):
                beds.append(read_bed(item, split))
            else:
                specs.append((split, item))
    return _Selection(specs, beds)


class _Builder:
    """Streams every source once, routing each record's bases to the regions that select them.

    With explicit train= and heldout=, a FASTA with an up-to-date samtools index is instead read region by
    region through pyfaidx (`genomelm.data.faidx`), with the same windows as the stream gives.
    """

    def __init__(
        self,
        cfg: DataConfig,
        folder: Path,
        progress: bool,
        md5s: dict[Path, str],
        selection: _Selection,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.progress, self.md5s, self.log = cfg, progress, md5s, log
        self.writers = {s: _SplitWriter(folder, s, cfg.seq, cfg.max_n_fraction) for s in SPLITS}
        self.selection = selection
        self.bed_by_record: dict[str, list[Interval]] = {}
        for iv in selection.bed_intervals:
            self.bed_by_record.setdefault(iv.record, []).append(iv)
        self.matched: set[tuple[str, str]] = set()
        self.seen: dict[str, Path] = {}

    def _regions_for(self, path: Path, record: str) -> list[_Region]:
        if record in self.seen:
            raise DataError(
                f"{path}: record {record!r} is also in {self.seen[record]}; record names must be unique"
            )
        self.seen[record] = path
        intervals = []
        for split, spec in self.selection.specs:
            interval = match_spec(spec, split, record)
            if interval is not None:
                intervals.append(interval)
                self.matched.add((split, spec))
        intervals += self.bed_by_record.get(record, [])
        check_overlaps(intervals)
        if not self.cfg.train:
            intervals += _complement(record, intervals)
        return [_Region(iv, self.writers[iv.split], self.cfg.seq, self.cfg.window_stride) for iv in intervals]

    def _finish_record(self, path: Path, record: str, length: int, regions: list[_Region]) -> None:
        for region in regions:
            iv = region.interval
            end = length if iv.end is None else iv.end
            if iv.end is None and iv.start == length:  # nothing left after a held-out range at the end
                continue
            if end > length:
                raise DataError(
                    f"{path}: region {iv.describe()} ends at base {end:,} but record {record} has {length:,} "
                    "bases; fix the region's end"
                )
            cutter, writer = region.cutter, region.writer
            if cutter.windows == 0:
                if not self.cfg.allow_short:
                    raise DataError(
                        f"{path}: {iv.describe()} has {end - iv.start:,} bases, fewer than SEQ="
                        f"{self.cfg.seq:,}; use a smaller seq=, "
                        "or allow_short=true to keep it as one padded window"
                    )
                writer.add(record, cutter.pad_short())
                writer.stats["padded_short"] += 1
            writer.stats["dropped_tail_bases"] += max(0, end - cutter.last_end)
            origin = {"origin": iv.origin} if iv.origin else {}  # the BED file and line
            writer.regions.append(
                {"spec": iv.spec, "record": record, "start": iv.start, "end": end, **origin}
            )

    def read(self, path: Path) -> dict:
        """Stream one FASTA file through the regions; returns its manifest entry.

        A downloaded file is checked against its expected md5 here, with the md5 the stream computes anyway
        (``fetch(..., verify_cached=False)`` skips its own pass); if reading fails, a checksum mismatch is
        reported instead, as ``fetch`` would have.
        """
        expected = self.md5s.get(path)
        index, why_not = region_index(path) if self.cfg.train and expected is None else (None, "")
        if index is None and why_not and self.selection.bed_files:
            self.log(f"{path}: reading the whole file ({why_not} to read only the BED regions)")
        try:
            entry = self._read_indexed(path, index) if index is not None else self._read(path)
        except DataError:
            if expected is not None:
                check_md5(path, md5_of(path), expected)
            raise
        if expected is not None:
            check_md5(path, entry["md5"], expected)
        return entry

    def _read(self, path: Path) -> dict:
        from tqdm import tqdm  # ~0.1 s; only needed when there is something to build

        stream = open_stream(path, table=SCAN_BYTES)  # FASTA (plain, gzip, BGZF) or .2bit
        size = path.stat().st_size
        record, offset, regions = "", 0, []
        bar = tqdm(
            total=size, unit="B", unit_scale=True, desc=f"tokenise {path.name}", disable=not self.progress
        )
        with bar:
            for event in stream:
                if isinstance(event, str):
                    if record:
                        self._finish_record(path, record, offset, regions)
                    record, offset, regions = event, 0, self._regions_for(path, event)
                    continue
                if regions:
                    self._feed(path, record, offset, event, stream.invalid, regions)
                offset += len(event)
                bar.update(min(size, stream.bytes_read) - bar.n)
            if record:
                self._finish_record(path, record, offset, regions)
        return {"path": str(path.resolve()), "format": stream.format, "bytes": size, "md5": stream.md5}

    def _read_indexed(self, path: Path, index: Path) -> dict:
        """Read only the selected regions of an indexed FASTA; returns its manifest entry (no md5: the file is
        not read whole)."""
        from tqdm import tqdm

        fasta = IndexedFasta(path, index)
        bar = tqdm(unit="b", unit_scale=True, desc=f"regions of {path.name}", disable=not self.progress)
        try:
            for record, length in fasta.records():
                regions = self._regions_for(path, record)
                for region in sorted(regions, key=lambda r: r.interval.start):  # as the stream meets them
                    iv = region.interval
                    offset = iv.start
                    end = length if iv.end is None else min(iv.end, length)
                    for raw in fasta.bases(record, iv.start, end, BLOCK_BYTES):
                        piece = raw.translate(SCAN_BYTES)
                        at = piece.find(INVALID_BYTE)
                        invalid = None if at < 0 else (at, chr(raw[at]))
                        self._feed(path, record, offset, piece, invalid, [region])
                        offset += len(raw)
                        bar.update(len(raw))
                self._finish_record(path, record, length, regions)
        finally:
            bar.close()
            fasta.close()
        size = path.stat().st_size
        return {
            "path": str(path.resolve()),
            "format": detect_format(path),
            "bytes": size,
            "md5": None,
            "index": str(index.resolve()),
        }

    def _feed(
        self,
        path: Path,
        record: str,
        offset: int,
        piece: bytes,
        invalid: tuple[int, str] | None,
        regions: list[_Region],
    ) -> None:
        """``piece``: bases [offset, offset + len) of ``record`` mapped through SCAN_BYTES; ``invalid``: the
        first base the table rejects (index in the piece, character) or None."""
        if invalid is not None:
            at, char = invalid
            raise DataError(
                f"{path}: record {record}, base {offset + at + 1:,} (1-based): invalid character "
                f"{char!r}; only A C G T N, IUPAC codes R Y K M S W B D H V (either case) are allowed"
            )
        scan = np.frombuffer(piece, dtype=np.uint8)
        codes = scan & CODE_MASK
        mask = (scan >= SOFT_BIT).view(np.uint8)
        end = offset + len(scan)
        for region in regions:
            iv = region.interval
            lo, hi = max(iv.start, offset), end if iv.end is None else min(iv.end, end)
            if lo < hi:
                region.feed(
                    codes[lo - offset : hi - offset],
                    mask[lo - offset : hi - offset],
                    scan[lo - offset : hi - offset],
                )

    def unmatched(self) -> list[str]:
        """Split items that selected no record read, as messages name them."""
        specs = [f"{spec!r} ({s})" for s, spec in self.selection.specs if (s, spec) not in self.matched]
        return specs + [iv.describe() for iv in self.selection.bed_intervals if iv.record not in self.seen]


def _sources(cfg: DataConfig, progress: bool) -> list[Path]:
    if cfg.source == "hg38":
        if not cfg.files:
            raise DataError("source hg38 needs `files` (e.g. chr1.fa.gz) in the data config")
        # Cached files are not hashed here: _Builder.read checks them with the md5 of its streaming read.
        return fetch(
            cfg.base_url, cfg.files, Path(cfg.cache) / cfg.genome, progress=progress, verify_cached=False
        )
    if not cfg.fasta:
        raise DataError(f"genome {cfg.genome!r} has no FASTA: give fasta=FILE (or a config with `fasta:`)")
    return [Path(p) for p in cfg.fasta]


def _check_settings(cfg: DataConfig) -> _Selection:
    """Errors that need no genome reading: no splits, bad BED lines, overlapping or too-short explicit
    regions. Returns what the splits select."""
    if not cfg.heldout:
        raise DataError(
            "no held-out split: give heldout= (record names, name:start-end or a BED file, "
            "comma-separated); train= defaults to everything not held out"
        )
    selection = _selection(cfg)
    intervals = [static_interval(spec, s) for s, spec in selection.specs] + selection.bed_intervals
    check_overlaps(intervals)
    for iv in intervals:
        if iv.end is not None and iv.end - iv.start < cfg.seq and not cfg.allow_short:
            raise DataError(
                f"region {iv.describe()} has {iv.end - iv.start:,} bases, fewer than SEQ={cfg.seq:,}; "
                "use a smaller seq=, or allow_short=true to keep it as one padded window"
            )
    return selection


def _fingerprint(cfg: DataConfig, sources: list[Path], vocab: Vocabulary, selection: _Selection) -> str:
    """Hash of everything that decides the output: settings, vocabulary, each source's size and mtime, and the
    BED files' contents."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("force", "out", "cache", "base_url")}
    stats = []
    for path in sources:
        if not path.is_file():
            raise DataError(f"{path}: no such FASTA file; check fasta= (or the `fasta:` of the data config)")
        info = path.stat()
        stats.append([str(path.resolve()), info.st_size, info.st_mtime_ns])
    beds = [[bed.split, str(bed.path.resolve()), bed.md5] for bed in selection.bed_files]
    hashed = [FORMAT_VERSION, settings, vocab.to_json(), stats] + (
        [beds] if beds else []
    )  # no BED entry when no BED file was given
    blob = json.dumps(hashed, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest of a complete prepared folder, or None if there is none; DataError naming the file and the
    command that rebuilds it when it is not valid JSON or lacks an entry the readers need."""
    return load_manifest(folder)


def _up_to_date(out: Path, fingerprint: str, force: bool, log: Callable[[str], None]) -> bool:
    """Whether ``out`` is an up-to-date build of ``fingerprint`` whose files all match its manifest (sizes
    and checksums, ~0.1 s per GB from the page cache). A folder of ours that is damaged, or was prepared
    before checksums were recorded, is to be rebuilt (said in the log); DataError for a folder that is not
    ours, which is never replaced."""
    try:
        existing = read_manifest(out)
    except DamagedFolder as err:
        if not holds_only_prepared_files(out):
            raise DataError(
                f"{err.path}: {err.problem}, and {out} holds files a prepared dataset does not; remove it "
                "or choose another out="
            ) from None
        log(f"{err.path}: {err.problem}; rebuilding {out}")
        return False
    if existing is None:
        if out.exists() and any(out.iterdir()):
            if not holds_only_prepared_files(out):
                raise DataError(
                    f"{out} exists and is not a prepared dataset (no {MANIFEST}); remove it or choose "
                    "another out="
                )
            log(f"{out / MANIFEST}: missing (an incomplete or damaged prepared folder); rebuilding {out}")
        return False
    if existing.get("fingerprint") != fingerprint or force:
        return False
    check = FolderCheck(out, existing)
    if not check.has_checksums:
        log(
            f"{out / MANIFEST} has no checksums (prepared by an older genomelm); rebuilding {out} to add them"
        )
        return False
    try:
        check.verify_folder()
    except DamagedFolder as err:
        log(f"{err.path}: {err.problem}; rebuilding {out}")
        return False
    return True


def _remove_stale(out: Path) -> None:
    """Delete temp folders of earlier runs on ``out`` whose process is gone (e.g. killed with -9)."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def format_report(manifest: dict) -> str:
    """Human-readable summary of a manifest: windows kept and dropped, bases, N and soft-masked share."""
    lines = [
        (
            f"{'split':<8} {'windows':>8} {'dropped N':>9} {'padded':>6} {'bases':>14} {'N %':>6} "
            f"{'IUPAC->N':>8} {'soft %':>6} {'tail dropped':>12}"
        )
    ]
    for split in SPLITS:
        st = manifest["splits"][split]["stats"]
        wb = max(st["window_bases"], 1)
        lines.append(
            f"{split:<8} {st['windows']:>8,} {st['dropped_n_windows']:>9,} {st['padded_short']:>6,} "
            f"{st['window_bases']:>14,} {100 * st['window_n'] / wb:>6.2f} {st['iupac_as_n']:>8,} "
            f"{100 * st['window_softmasked'] / wb:>6.2f} {st['dropped_tail_bases']:>12,}"
        )
    return "\n".join(lines)


def prepare(cfg: DataConfig, command: str, progress: bool = True, log: Callable[[str], None] = print) -> Path:
    """Build ``cfg.out_dir`` (see module docstring) unless an identical build is already there; returns it."""
    selection = _check_settings(cfg)
    vocab = tokenizer_vocabulary(cfg.tokenizer) if cfg.tokenizer else BUILTIN
    sources = _sources(cfg, progress)
    fingerprint = _fingerprint(cfg, sources, vocab, selection)
    out = cfg.out_dir
    if _up_to_date(out, fingerprint, cfg.force, log):
        log(
            f"{out} is up to date (same inputs and settings, files match their checksums); nothing to do. "
            "Give force=true to rebuild."
        )
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        began = time.perf_counter()
        md5s = {p: expected_md5(p.parent, p.name) for p in sources} if cfg.source == "hg38" else {}
        builder = _Builder(cfg, temp, progress, md5s, selection, log)
        source_entries = [builder.read(path) for path in sources]
        missing = builder.unmatched()
        if missing:
            names = ", ".join(sorted(builder.seen)[:20])
            raise DataError(
                "not found in "
                + ", ".join(str(p) for p in sources)
                + ": "
                + ", ".join(missing)
                + f"; records present: {names}; fix train=/heldout="
                + (" or the BED file" if selection.bed_files else "")
            )
        splits = {s: w.finalize() for s, w in builder.writers.items()}
        empty = [s for s in SPLITS if splits[s]["stats"]["windows"] == 0]
        if empty:
            raise DataError(
                f"split(s) {', '.join(empty)} kept no windows (all dropped for N > {cfg.max_n_fraction}); "
                "choose other regions or raise max_n_fraction="
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "genome": cfg.genome,
            "command": command,
            "fingerprint": fingerprint,
            "settings": {k: v for k, v in asdict(cfg).items() if k != "force"},
            "seq_len": cfg.seq,
            "stride": cfg.window_stride,
            "max_n_fraction": cfg.max_n_fraction,
            "vocab": vocab.to_json(),
            "sources": source_entries,
            "split_files": [
                {"split": b.split, "path": str(b.path.resolve()), "md5": b.md5, "intervals": len(b.intervals)}
                for b in selection.bed_files
            ],
            "splits": splits,
            "checksums": {
                "hash": HASH,
                "block_bytes": HASH_BLOCK_BYTES,
                "files": {name: entry for w in builder.writers.values() for name, entry in w.files.items()},
            },
            "seconds": round(time.perf_counter() - began, 3),
        }
        manifest["report"] = format_report(manifest)
        part = temp / (MANIFEST + ".part")
        part.write_text(json.dumps(manifest, indent=1))
        os.replace(part, temp / MANIFEST)
        _swap_into_place(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    log(manifest["report"])
    log(f"wrote {out} in {manifest['seconds']:.1f} s")
    return out


def _swap_into_place(temp: Path, out: Path) -> None:
    """Rename ``temp`` to ``out``; an older ``out`` is first moved aside, then deleted."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(temp, out)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(out.parent, os.O_RDONLY)  # make the renames durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
