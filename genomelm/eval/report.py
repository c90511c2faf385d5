"""Writers of an evaluation result: `buckets.json`, `buckets.csv`, and the result sets they are written in.

A result is the dict `genomelm.eval.evaluate.evaluate_sets` builds; for one held-out folder: settings,
buckets, overall, context_cut, contrast (from `genomelm.eval.paired`), provenance, and the per-window rows
that `genomelm.eval.window_table` writes to windows.csv. With several folders (`heldout=dirA,dirB`) it
is {settings, sets: [{name, **one-folder result}, ...], provenance}; `result_sets` gives the per-folder
results of either form. NaN (no tokens, fewer than 2 windows) is written as JSON null and as an empty CSV
cell. The printed table is `genomelm.eval.table.format_table`.

`write_result_set` writes the files of one result (eval's, the probe's) as a set: a reader sees either the
whole previous set or the whole new one, and a failed write (disk full) leaves the previous set as it was.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from genomelm.data.errors import file_system
from genomelm.eval.buckets import STATS, SUBSETS


def jsonable(value: Any) -> Any:
    """`value` with every NaN/inf float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary name in the same folder (removed if the write fails), then
    rename into place. One file only: the files of a result are written as a set by `write_result_set`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class WriteError(OSError):
    """A result set could not be written (disk full, no permission): one line naming the file system and the
    file; the previous set is left as it was."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_result_set(
    folder: Path, name: str, writers: dict[str, Callable[[Path], object]]
) -> dict[str, Path]:
    """Write one result's files as a set into `folder` (created if needed): `writers` maps each file name to a
    function that writes that file at the path it is given. Returns {file name: folder / file name}.

    Layout, for eval's set `name="buckets"` in results/<run>/ (the probe's set "copy_probe" sits beside it the
    same way and is never touched by an eval write, nor is anything else in the folder)::

        buckets.json -> .buckets/buckets.json     one fixed link per file: the paths readers open
        .buckets -> .buckets.gen-1a2b3c4d5e6f     the only link that changes
        .buckets.gen-1a2b3c4d5e6f/                the current set: buckets.json, buckets.csv, ...
        .buckets.lock                             held while a set is written

    A write makes a new generation folder beside the current one (same file system), writes every file
    there, flushes them to disk, and then swaps `.buckets` to it by renaming a new link over it: one atomic
    rename(2), so `folder/buckets.json` and `folder/loss_by_position.png` always resolve into the same
    generation. The previous generation is removed afterwards. A reader that must read several files of one
    set while a write may happen resolves `folder/.buckets` once (`os.path.realpath`) and reads from there.
    The fixed links of a first write are made after its swap (until then there is nothing to open).

    On any failure (an OSError, also an exception in a writer) the new generation is removed and the link
    still points at the previous set, complete; OSErrors are raised as `WriteError`, "no space left on
    <device> (<mount point>) writing <folder/file>" for a full disk. What a killed write leaves (a
    generation no link points at, a half-made link) is removed by the next write. Writes of one set are
    serialised by a lock on `.<name>.lock`. Plain files from before this layout are first moved into a
    generation of their own (hard links), each replaced by its link, so even that step never mixes sets.
    """
    pointer = folder / f".{name}"
    where = folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder / f".{name}.lock"):
            current = os.readlink(pointer) if pointer.is_symlink() else None
            _remove_leftovers(folder, name, keep=current)
            if current is None:
                _adopt_plain_files(folder, name, list(writers))
            for file in writers:  # what readers can open there now becomes a link before the swap
                where = folder / file
                if os.path.lexists(where):
                    _ensure_link(where, f"{pointer.name}/{file}", name)
            where = folder
            generation = _new_generation(folder, name)
            try:
                for file, write in writers.items():
                    where = folder / file
                    write(generation / file)
                    _fsync(generation / file)
                where = folder
                _fsync(generation)
                old = os.readlink(pointer) if pointer.is_symlink() else None
                _point(pointer, generation.name, name)
            except BaseException:
                shutil.rmtree(generation, ignore_errors=True)
                raise
            for file in writers:  # the links of a first write (or of files new to the set) after it
                where = folder / file
                _ensure_link(where, f"{pointer.name}/{file}", name)
            where = folder
            _fsync(folder)
            if old is not None and old != generation.name:
                shutil.rmtree(folder / old, ignore_errors=True)
    except OSError as exc:
        raise write_error(exc, where) from exc
    return {file: folder / file for file in writers}


def write_error(exc: OSError, path: Path) -> WriteError:
    """`exc`, raised writing `path`, as a one-line WriteError: for a full disk, "no space left on <device>
    (<mount point>) writing <path>"."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        message = f"{what} on {file_system(path)} writing {path}"
    else:
        message = f"{exc.strerror or exc} writing {path}"
    error = WriteError(exc.errno, message + "; the previous result there is unchanged")
    error.filename = str(path)
    return error


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _generation_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.(gen|tmp)-[0-9a-f]+")


def _new_generation(folder: Path, name: str) -> Path:
    generation = folder / f".{name}.gen-{secrets.token_hex(6)}"
    generation.mkdir()
    return generation


def _remove_leftovers(folder: Path, name: str, keep: str | None) -> None:
    """Generations no link points at and half-made links, left by a killed write (none else runs: locked)."""
    pattern = _generation_pattern(name)
    for entry in folder.iterdir():
        if entry.name != keep and pattern.fullmatch(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _adopt_plain_files(folder: Path, name: str, files: list[str]) -> None:
    """Files of the set written as plain files (before this layout): hard-linked (copied where that fails)
    into a generation the set's link then points at, so that replacing each by its link changes no content."""
    plain = [file for file in files if (folder / file).is_file() and not (folder / file).is_symlink()]
    if not plain:
        return
    generation = _new_generation(folder, name)
    try:
        for file in plain:
            try:
                os.link(folder / file, generation / file)
            except OSError:
                shutil.copy2(folder / file, generation / file)
        _point(folder / f".{name}", generation.name, name)
    except BaseException:
        shutil.rmtree(generation, ignore_errors=True)
        raise


def _ensure_link(path: Path, target: str, name: str) -> None:
    if not (path.is_symlink() and os.readlink(path) == target):
        _point(path, target, name)


def _point(link: Path, target: str, name: str) -> None:
    """Make `link` a symbolic link to `target` in one rename (atomic, replacing what is there)."""
    tmp = link.with_name(f".{name}.tmp-{secrets.token_hex(6)}")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (a no-op where the file system cannot: EINVAL, ENOTSUP)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def without_window_rows(result: dict) -> dict:
    """`result` without its per-window rows ("window_rows", one or per set): those go to windows.csv."""
    out = {k: v for k, v in result.items() if k != "window_rows"}
    if "sets" in out:
        out["sets"] = [without_window_rows(one) for one in out["sets"]]
    return out


def write_json(result: dict, path: Path) -> Path:
    text = json.dumps(jsonable(without_window_rows(result)), indent=2, allow_nan=False)
    return write_atomic(path, text + "\n")


def result_sets(result: dict) -> list[tuple[str, dict]]:
    """(name, one-folder result) per held-out folder, for a one-folder or a several-folder result."""
    if "sets" in result:
        return [(entry["name"], entry) for entry in result["sets"]]
    return [(Path(str(result["provenance"].get("data_dir", "heldout"))).name, result)]


# the paired intervals' columns of each change in buckets.csv: <change>_<field> (<change>_se, ...)
INTERVAL_FIELDS = ("se", "low", "high", "windows", "excludes_zero")


def csv_columns(several: bool = False) -> list[str]:
    """One CSV row per bucket (and held-out folder, first column `heldout`, when there are several): its
    positions, each model's statistics, the relative changes and, after those, the changes in nats and every
    change's paired interval."""
    columns = (["heldout"] if several else []) + ["bucket", "start", "end"]
    for prefix in SUBSETS:
        columns += [f"{model}_{prefix}{stat}" for model in ("before", "after") for stat in STATS]
        columns.append(f"{prefix}change")
    for prefix in SUBSETS:
        for change in (f"{prefix}change", f"{prefix}change_nats"):
            columns += ([change] if change.endswith("nats") else []) + [
                f"{change}_{field}" for field in INTERVAL_FIELDS
            ]
    return columns


def write_csv(result: dict, path: Path) -> Path:
    several = "sets" in result
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=csv_columns(several), lineterminator="\n")
    writer.writeheader()
    for name, one in result_sets(result):
        for i, bucket in enumerate(jsonable(one["buckets"])):
            row: dict[str, Any] = {"heldout": name} if several else {}
            row.update({"bucket": i, "start": bucket["start"], "end": bucket["end"]})
            for prefix in SUBSETS:
                for model in ("before", "after"):
                    row.update({f"{model}_{prefix}{stat}": bucket[model][prefix + stat] for stat in STATS})
                row[f"{prefix}change"] = bucket[prefix + "change"]
                row[f"{prefix}change_nats"] = bucket[prefix + "change_nats"]
            for change, interval in bucket["intervals"].items():
                row.update({f"{change}_{field}": interval[field] for field in INTERVAL_FIELDS})
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return write_atomic(path, out.getvalue())


def format_number(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
