"""What checking a prepared folder's bytes costs: open + verify of the training split, the lazy mode, and the
up-to-date check of `genomelm data`, against reading the same bytes without hashing.

    python benchmarks/data_verify.py [--mb 545] [--seq 512k] [--repeat 3] [--work data/cache/bench]

Builds (once, with the project's own writer: `genomelm data`, in this process) a prepared folder from a
FASTA of --mb megabases tiled from the bundled fly chr4 (data_throughput.make_fasta: 90 % train record, 10 %
held out). The default, 545 Mb at SEQ 512k, gives a training split of ~490 MB of codes (+ as much soft-mask),
the size of hg38 chr1 + chr2 at 512k. Timings are the best of --repeat with the files in the page cache,
except the "cold" rows, timed right after evicting the folder's files from it (posix_fadvise; the rest of
the cache is left alone); the hash rows hash a 256 MiB buffer in memory. Opening excludes megatron-core's
first import (~5 s, paid once per process whatever is checked).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import xxhash
from data_throughput import ROOT, make_fasta

from genomelm.commands.data import main as data_main
from genomelm.data import read_manifest
from genomelm.data.integrity import HASH_BLOCK_BYTES, BlockHasher, FolderCheck, folder_files, split_files


def best(repeat: int, func) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        func()
        times.append(time.perf_counter() - began)
    return min(times)


def read_only(paths: list[Path]) -> None:
    """Read the files through an 8 MiB buffer, as the verifier does, without hashing: the floor."""
    buffer = memoryview(bytearray(8 << 20))
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (posix_fadvise; other files are left alone), so the next
    read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold(repeat: int, paths: list[Path], func) -> float:
    """Best of ``repeat`` timings of ``func`` right after evicting ``paths``."""
    times = []
    for _ in range(repeat):
        evict(paths)
        began = time.perf_counter()
        func()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=545, help="megabases of the generated FASTA")
    parser.add_argument("--seq", default="512k")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "cache" / "bench")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    fasta = make_fasta(args.work, args.mb)
    out = args.work / f"verify-{args.mb}mb-{args.seq}"
    command = [
        sys.executable,
        "-m",
        "genomelm.commands.data",
        "--fasta",
        str(fasta.resolve()),
        "--seq",
        args.seq,
        "--heldout",
        "held",
        "--out",
        str(out),
        "--no-progress",
    ]
    logs = io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stdout(logs):
        assert data_main(command[3:]) == 0  # in this process: the same writer, and the same fingerprint
    built = time.perf_counter() - began
    how = "found up to date" if "up to date" in logs.getvalue() else "built"
    manifest = read_manifest(out)
    train_files = [out / name for name in split_files(manifest["splits"]["train"])]
    all_files = [out / name for name in folder_files(manifest)]
    train_bytes = sum(p.stat().st_size for p in train_files)
    all_bytes = sum(p.stat().st_size for p in all_files)
    codes_bytes = (out / "train.bin").stat().st_size

    from genomelm.data import WindowDataset  # imports megatron-core (~5 s), not part of the timings

    WindowDataset(out, "heldout")
    read_only(all_files)  # into the page cache
    rows: list[tuple[str, int, float]] = []
    rows.append(
        ("read only, no hash (floor)", train_bytes, best(args.repeat, lambda: read_only(train_files)))
    )
    rows.append(
        (
            "WindowDataset open, verify=open",
            train_bytes,
            best(args.repeat, lambda: WindowDataset(out, "train")),
        )
    )
    rows.append(
        (
            "read only, cold (evicted first)",
            train_bytes,
            cold(args.repeat, train_files, lambda: read_only(train_files)),
        )
    )
    rows.append(
        (
            "WindowDataset open, verify=open, cold",
            train_bytes,
            cold(args.repeat, train_files, lambda: WindowDataset(out, "train")),
        )
    )
    read_only(all_files)
    lazy_open = best(args.repeat, lambda: WindowDataset(out, "train", verify="lazy"))
    rows.append(("WindowDataset open, verify=lazy", 0, lazy_open))

    times, hashed = [], 0
    for _ in range(args.repeat):
        lazy = WindowDataset(out, "train", verify="lazy")
        began = time.perf_counter()
        lazy[0]
        times.append(time.perf_counter() - began)
        hashed = lazy.check.hashed_bytes - sum(p.stat().st_size for p in train_files if p.suffix == ".idx")
    label = f"  + first window read (its {HASH_BLOCK_BYTES >> 20} MiB block of both .bin)"
    rows.append((label, hashed, min(times)))
    rows.append(
        (
            "up-to-date check, whole folder",
            all_bytes,
            best(args.repeat, lambda: FolderCheck(out, manifest).verify_folder()),
        )
    )
    noop = best(args.repeat, lambda: subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL))
    buffer = np.random.default_rng(0).integers(0, 6, 256 << 20, dtype=np.uint8).tobytes()
    window = 1 << 19

    def writer_hash() -> None:
        hasher = BlockHasher()
        view = memoryview(buffer)
        for at in range(0, len(buffer), window):
            hasher.update(view[at : at + window])

    hashes = [
        ("xxh3_128 in memory (the one used)", lambda: xxhash.xxh3_128(buffer).hexdigest()),
        ("  as the writer feeds it, 512 KiB pieces", writer_hash),
        ("blake2b in memory (hashlib)", lambda: hashlib.blake2b(buffer).hexdigest()),
        ("sha256 in memory (hashlib)", lambda: hashlib.sha256(buffer).hexdigest()),
    ]
    rows += [(label, len(buffer), best(args.repeat, func)) for label, func in hashes]

    print(
        f"prepared folder {out}: train codes {codes_bytes / 1e6:,.0f} MB, all files {all_bytes / 1e6:,.0f} MB"
    )
    print(f"({how} in {built:.1f} s by `genomelm data`, run in this process)")
    print(f"{'step':<52} {'bytes':>15} {'seconds':>8} {'GB/s':>7}")
    for label, size, seconds in rows:
        rate = f"{size / seconds / 1e9:>7.2f}" if size else f"{'':>7}"
        print(f"{label:<52} {size:>15,} {seconds:>8.3f} {rate}")
    print(f"{'`genomelm data` re-run, up to date (wall)':<52} {all_bytes:>15,} {noop:>8.3f}")
    print(f"best of {args.repeat}; files in the page cache unless cold; GB = 1e9 bytes")
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        sys.exit(main())
