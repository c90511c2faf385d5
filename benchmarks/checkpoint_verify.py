"""What checking a checkpoint's bytes costs: xxh3-128 (`genomelm.parallel.checkpoint.file_checksum`) of a
shard-sized file on this machine, and what that means per rank for the full-size sharded checkpoint.

    .venv/bin/python benchmarks/checkpoint_verify.py [--mib 1024]

A sharded checkpoint holds, per parameter, its fp32 value and AdamW's two fp32 moments (12 B); every rank
hashes what it wrote when it saves, and on `resume=auto` reads and hashes its share of every file (1/world of
the bytes), so the time per rank is its share over the hashing rate (the disk's read rate, if slower).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from genomelm.parallel.checkpoint import file_checksum

FULL_SIZE_PARAMETERS = 313.33e9  # GLM-5.3-Flash
BYTES_PER_PARAMETER = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of the file hashed, MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shard.distcp"
        with open(path, "wb") as out:
            for _ in range(args.mib):
                out.write(os.urandom(1 << 20))
        file_checksum(path)  # warm the page cache: the rate of the hash, not of this machine's disk
        started = time.perf_counter()
        file_checksum(path)
        seconds = time.perf_counter() - started
    gb = args.mib * (1 << 20) / 1e9
    rate = gb / seconds
    print(
        f"| what | bytes | seconds | GB/s |\n|---|---|---|---|\n| xxh3-128 of one file | {gb:.2f} GB | "
        f"{seconds:.2f} | {rate:.2f} |"
    )
    total = FULL_SIZE_PARAMETERS * BYTES_PER_PARAMETER / 1e9
    for world in (64,):
        share = total / world
        print(
            f"| full-size checkpoint, one rank's share at {world} ranks (projected) | {share:.0f} GB | "
            f"{share / rate:.0f} | {rate:.2f} |"
        )


if __name__ == "__main__":
    main()
