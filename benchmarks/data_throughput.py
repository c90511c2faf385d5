"""Throughput and peak memory of `genomelm data`, end to end, against a naive pyfaidx + Python-loop baseline.

    python benchmarks/data_throughput.py [--mb 120] [--repeat 3] [--fasta FILE.fa] [--code CHECKOUT ...]

Builds (once, into --work) a FASTA of --mb megabases by tiling the bundled D. melanogaster chr4 (every
other tile upper-cased, so case and the N run vary) as two records, `big` (train) and `held` (10 %),
and its plain-gzip copy, plus one of --mb/2 for the memory slope. Each `genomelm data` run is a subprocess;
its peak RSS comes from wait4(). Rates are reported both for the whole process (wall) and for the work
alone (the manifest's "seconds"), with a projection to --project-mb (default hg38 chr1+chr2+chr22).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
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


def run_genomelm(fasta: Path, out: Path, code: Path = ROOT, force: bool = True) -> tuple[float, float, float]:
    """(wall s, work s from the manifest, peak RSS MB) of one `genomelm data` subprocess run from ``code``."""
    cmd = [
        sys.executable,
        "-m",
        "genomelm.commands.data",
        "--fasta",
        str(fasta.resolve()),
        "--seq",
        "1M",
        "--heldout",
        "held",
        "--out",
        str(out),
        "--no-progress",
    ] + (["--force"] if force else [])
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=code, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    if status != 0:
        raise SystemExit(f"genomelm data failed on {fasta} (status {status})")
    seconds = json.loads((out / "manifest.json").read_text())["seconds"]
    return wall, seconds, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def decompress_only(gz: Path) -> float:
    """Seconds to decompress ``gz`` with ISA-L alone: the floor for one plain-gzip stream on one core."""
    from isal import igzip

    began = time.perf_counter()
    with igzip.open(gz, "rb") as handle:
        while handle.read(8 << 20):
            pass
    return time.perf_counter() - began


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
    parser.add_argument(
        "--mb", type=int, default=120, help="megabases of the generated FASTA (also runs mb/2)"
    )
    parser.add_argument("--fasta", type=Path, help="use this plain FASTA (records big and held) instead")
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "cache" / "bench")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the table shows the median")
    parser.add_argument(
        "--project-mb", type=float, default=542.0, help="size to project (hg38 chr1+chr2+chr22)"
    )
    parser.add_argument("--baseline-mb", type=float, default=2.0, help="subset timed for the naive baseline")
    parser.add_argument(
        "--code",
        type=Path,
        nargs="+",
        default=[ROOT],
        help="checkouts to measure, runs interleaved (e.g. a `git worktree` of the last commit)",
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    plain = args.fasta or make_fasta(args.work, args.mb)
    half = make_fasta(args.work, args.mb // 2) if not args.fasta else None
    gz = gzip_copy(plain)
    mb = bases_of(plain) / 1e6
    inputs = [("plain gzip", gz, mb), ("plain text", plain, mb)]
    if half is not None:
        inputs.append(("plain gzip", gzip_copy(half), bases_of(half) / 1e6))
    times: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    noop: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for _ in range(args.repeat):  # interleaved, so load from other jobs hits every variant alike
            for c, code in enumerate(args.code):
                for i, (_, path, _) in enumerate(inputs):
                    times.setdefault((c, i), []).append(run_genomelm(path, Path(tmp) / f"out{c}", code))
                last = inputs[-1][1]  # just built from it: this run finds the folder up to date
                noop.setdefault(c, []).append(run_genomelm(last, Path(tmp) / f"out{c}", code, force=False)[0])
    decompress = min(decompress_only(gz) for _ in range(args.repeat))
    speed, measured = naive_baseline(plain, args.work, args.baseline_mb)

    med = statistics.median
    print(
        f"{'pipeline':<34} {'Mb':>6} {'Mb/s wall':>9} {'Mb/s work':>9} {'wall s':>7} {'work s':>7} "
        f"{'RSS MB':>7}  {'proj. ' + format(args.project_mb, '.0f') + ' Mb':>12}"
    )
    for c, code in enumerate(args.code):
        tag = "" if len(args.code) == 1 else f" [{code.name}]"
        for i, (label, _, size) in enumerate(inputs):
            runs = times[(c, i)]
            wall, work, rss = med(r[0] for r in runs), med(r[1] for r in runs), max(r[2] for r in runs)
            project = (wall - work) + work * args.project_mb / size  # fixed start-up cost + work per Mb
            print(
                f"{'genomelm data, ' + label + tag:<34} {size:>6.1f} {size / wall:>9.1f} {size / work:>9.1f} "
                f"{wall:>7.2f} {work:>7.2f} {rss:>7.0f}  {project:>10.1f} s"
            )
        print(f"{'up-to-date re-run (no-op)' + tag:<34} {'':>6} {'':>9} {'':>9} {med(noop[c]):>7.2f}")
        if half is not None:
            (_, _, big), (_, _, small) = inputs[0], inputs[2]
            rss_big, rss_small = max(r[2] for r in times[(c, 0)]), max(r[2] for r in times[(c, 2)])
            slope = (rss_big - rss_small) / (big - small)
            print(
                f"  memory{tag}: peak RSS {rss_small:.0f} MB at {small:.0f} Mb, {rss_big:.0f} MB at "
                f"{big:.0f} Mb: slope {slope:.2f} MB per Mb; projected for a 250 Mb chromosome: "
                f"{rss_big + slope * (250 - big):.0f} MB"
            )
    print(
        f"{'ISA-L decompression alone':<34} {mb:>6.1f} {mb / decompress:>9.1f} {mb / decompress:>9.1f} "
        f"{decompress:>7.2f} {decompress:>7.2f}"
    )
    print(
        f"{'naive: pyfaidx + Python loop':<34} {mb:>6.1f} {speed:>9.1f} {speed:>9.1f}  "
        f"(timed on {measured:.1f} Mb, extrapolated)"
    )
    print(
        f"median of {args.repeat} interleaved runs (RSS: max). wall = whole subprocess incl. interpreter "
        "start and imports; work = manifest 'seconds' (read, translate, write);\nprojection = (wall - work) "
        f"+ work scaled to {args.project_mb:.0f} Mb"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
