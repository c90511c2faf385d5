"""Throughput and peak memory of `genomelm data`, end to end, against a naive pyfaidx + Python-loop baseline.

    python benchmarks/data_throughput.py [--mb 60] [--fasta FILE.fa] [--work data/cache/bench]

Builds (once, into --work) a FASTA of --mb megabases by tiling the bundled D. melanogaster chr4 (every
other tile upper-cased, so case and the N run vary) as two records, `big` (train) and `held` (10 %),
and its plain-gzip copy. Each `genomelm data` run is a subprocess; its peak RSS comes from wait4().
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyfaidx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "dmel_chr4.fa.gz"
LINE = 60


def _write_records(path: Path, records: dict[str, bytes]) -> None:
    with open(path, "wb") as out:
        for name, seq in records.items():
            out.write(b">" + name.encode() + b"\n")
            lines = np.frombuffer(seq[: len(seq) // LINE * LINE], dtype=np.uint8).reshape(-1, LINE)
            out.write(np.hstack([lines, np.full((len(lines), 1), 10, np.uint8)]).tobytes())
            out.write(seq[len(seq) // LINE * LINE :] + b"\n")


def make_fasta(work: Path, mb: int) -> Path:
    """Plain FASTA of ``mb`` megabases tiled from the demo genome (written once, then reused)."""
    path = work / f"tiled-{mb}mb.fa"
    if path.exists():
        return path
    demo = b"".join(gzip.decompress(DEMO.read_bytes()).split(b"\n")[1:])
    tiles = [demo if i % 2 else demo.upper() for i in range(mb * 1_000_000 // len(demo) + 1)]
    seq = b"".join(tiles)[: mb * 1_000_000]
    cut = len(seq) * 9 // 10
    part = path.with_suffix(".part")
    _write_records(part, {"big": seq[:cut], "held": seq[cut:]})
    part.replace(path)
    return path


def gzip_copy(path: Path) -> Path:
    """Plain (not BGZF) gzip copy, like UCSC's files."""
    gz = path.with_name(path.name + ".gz")
    if not gz.exists():
        part = gz.with_suffix(".part")
        with open(path, "rb") as src, gzip.open(part, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        part.replace(gz)
    return gz


def bases_of(path: Path) -> int:
    return sum(len(pyfaidx.Fasta(str(path), rebuild=True)[name]) for name in ("big", "held"))


def run_genomelm(fasta: Path, out: Path) -> tuple[float, float, float]:
    """(wall s, processing s from the manifest, peak RSS MB) of one `genomelm data` subprocess."""
    cmd = [sys.executable, "-m", "genomelm.data.command", "--fasta", str(fasta), "--seq", "1M",
           "--heldout", "held", "--out", str(out), "--force", "--no-progress"]  # fmt: skip
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    if status != 0:
        raise SystemExit(f"genomelm data failed on {fasta} (status {status})")
    seconds = json.loads((out / "manifest.json").read_text())["seconds"]
    return wall, seconds, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def naive_baseline(fasta: Path, work: Path, mb: float) -> tuple[float, float]:
    """(Mb/s, Mb measured): pyfaidx reads each record of an ``mb`` subset, a Python loop maps letters."""
    subset = work / f"subset-{mb}mb.fa"
    if not subset.exists():
        with open(fasta, "rb") as src:
            src.readline()
            body = src.read(int(mb * 1_000_000 * (LINE + 1) / LINE)).replace(b"\n", b"")
        _write_records(subset, {"big": body})
    table = {c: i for i, c in enumerate("-ACGTN", start=0)}
    table.update({c.lower(): i for c, i in table.items()})
    began = time.perf_counter()
    genome = pyfaidx.Fasta(str(subset), rebuild=True)
    total = 0
    for record in genome:
        ids = [table[c] for c in str(record[:])]
        total += len(ids)
    return total / 1e6 / (time.perf_counter() - began), total / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=60, help="megabases of the generated FASTA")
    parser.add_argument("--fasta", type=Path, help="use this plain FASTA (records big and held) instead")
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "cache" / "bench")
    parser.add_argument("--baseline-mb", type=float, default=2.0, help="subset timed for the naive baseline")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    plain = args.fasta or make_fasta(args.work, args.mb)
    half = make_fasta(args.work, args.mb // 2) if not args.fasta else None
    gz = gzip_copy(plain)
    mb = bases_of(plain) / 1e6
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for label, path in (("plain gzip", gz), ("plain text", plain)):
            wall, seconds, rss = run_genomelm(path, Path(tmp) / "out")
            rows.append((f"genomelm data, {label}", mb, mb / wall, mb / seconds, rss, "measured"))
        if half is not None:
            half_mb = bases_of(half) / 1e6
            wall, seconds, half_rss = run_genomelm(gzip_copy(half), Path(tmp) / "out")
            rows.append(
                (
                    "genomelm data, plain gzip",
                    half_mb,
                    half_mb / wall,
                    half_mb / seconds,
                    half_rss,
                    "measured",
                )
            )
    speed, measured = naive_baseline(plain, args.work, args.baseline_mb)
    rows.append(("naive: pyfaidx + Python loop", mb, speed, speed, float("nan"),
                 f"timed on {measured:.1f} Mb, extrapolated"))  # fmt: skip
    print(f"{'pipeline':<32} {'Mb':>6} {'Mb/s (wall)':>11} {'Mb/s (work)':>11} {'peak RSS MB':>11}  note")
    for name, size, wall_speed, work_speed, rss, note in rows:
        print(f"{name:<32} {size:>6.1f} {wall_speed:>11.1f} {work_speed:>11.1f} {rss:>11.0f}  {note}")
    print(
        "wall = whole subprocess incl. interpreter start and imports; work = manifest 'seconds' (read+write)"
    )
    if half is not None:
        slope = (rows[0][4] - rows[2][4]) / (rows[0][1] - rows[2][1])
        print(f"memory slope {slope:.2f} MB per Mb (gzip runs at {rows[2][1]:.0f} and {mb:.0f} Mb); "
              f"projected peak RSS for a 250 Mb chromosome: {rows[0][4] + slope * (250 - mb):.0f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
