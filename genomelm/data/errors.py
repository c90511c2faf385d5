"""The errors every stage reports as one line: bad input (`DataError`, the data stage's) and a full disk
(`DiskFull`, for any write: prepared data, checkpoints, metrics, results).

A full disk shows up in many forms: an OSError with ENOSPC or EDQUOT, safetensors' Rust error ("os error 28"),
torch.save's short write ("unexpected pos"), torch.distributed.checkpoint's per-rank failures. `space_checked`
turns any of them into one `DiskFull` naming the device, the path, what the write needed and what is free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class DataError(Exception):
    """Bad input or settings for ``genomelm data``; the message says which file and how to fix it."""


class DiskFull(OSError):
    """A write that ran out of disk space or quota; the message names the device, the path, the size the
    write needed and what is free."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno 28] ...: 'path'"
        return str(self.strerror)


def out_of_space(error: BaseException, folder: Path | None = None, needed: int = 0) -> bool:
    """Whether `error`, or any error it came from, is a full disk (see the module docstring); a short
    torch.save write counts when `folder`'s free space cannot hold `needed` bytes."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        exc = todo.pop()
        if exc in seen:
            continue
        seen.append(exc)
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [
                getattr(f, "exc", f)
                for f in failures.values()
                if isinstance(getattr(f, "exc", f), BaseException)
            ]
    for exc in seen:
        text = str(exc)
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
    short_write = any("unexpected pos" in str(exc) for exc in seen)
    return short_write and folder is not None and free_bytes(folder) < needed


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (of its nearest existing folder)."""
    folder = Path(os.path.abspath(path))
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def file_system(path: Path) -> str:
    """The device holding `path` and its mount point ("/dev/sda1 (/work)"), or just the mount point."""
    mount = Path(os.path.abspath(path))
    while not os.path.ismount(mount):
        mount = mount.parent
    device = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == str(mount):
                device = fields[0]  # the last one mounted there is the one seen
    return f"{device} ({mount})" if device else str(mount)


def size_text(count: int) -> str:
    """A byte count for people: "812 B", "4.3 kB", "3.41 MB", "1.25 GB", "59.1 TB" (powers of 1000)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def disk_full(path: Path, needed: int, what: str, after: str = "") -> DiskFull:
    """The `DiskFull` of writing `what` (e.g. "the checkpoint") at `path`: "no space left on <device> writing
    <path> (<what> needs about <size>, <free> free)" and `after` (what was kept, what to do)."""
    path = Path(path)
    need = f"{what} needs about {size_text(needed)}, " if needed > 0 else ""
    error = DiskFull(
        errno.ENOSPC,
        f"no space left on {file_system(path)} writing {path} ({need}{size_text(free_bytes(path))} free)"
        + (f"; {after}" if after else ""),
    )
    error.filename = str(path)
    return error


@contextlib.contextmanager
def space_checked(
    path: Path, needed: int, what: str, after: str = "", remove: Path | None = None
) -> Iterator[None]:
    """Writes of `what` at `path` (`needed` bytes): on any failure remove `remove` (a temporary folder) first;
    a full disk becomes `disk_full(...)`, other errors pass unchanged."""
    try:
        yield
    except BaseException as exc:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and out_of_space(
            exc, Path(path).parent, needed
        ):
            raise disk_full(path, needed, what, after) from exc
        raise
