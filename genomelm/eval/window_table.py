"""The per-window file beside an evaluation's table, `results/<run>/windows.csv`, and its reader.

One row per held-out window and position bucket (with several held-out folders, a first column `heldout`
names the folder):

    window, record, start, end     the window's index in its folder's held-out split and its source
                                   coordinates (0-based, half-open; empty when the scored windows had none)
    bucket, bucket_start, bucket_end   the bucket and its positions in the window (half-open)
    tokens, before_sum, after_sum  the bucket's valid tokens and each model's loss sum over them (nats)
    repeat_tokens, before_repeat_sum, after_repeat_sum        the same over soft-masked targets
    unmasked_tokens, before_unmasked_sum, after_unmasked_sum  and over upper-case targets
    before_cut_sum, after_cut_sum, cut_context                the last bucket's sums with its context cut to
                                   cut_context tokens (empty in other buckets and without the cut)

Every number of `buckets.json` is a function of these sums (`genomelm.eval.paired`), and floats are written
as Python's shortest exact repr, so `recompute` gives back the table's numbers from the file alone; a reader
can also merge buckets, split by record, or bootstrap without the model.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from genomelm.eval.buckets import SUBSETS, BucketSums
from genomelm.eval.paired import WindowSums, summarise
from genomelm.eval.report import result_sets, write_atomic

FILE = "windows.csv"
COORDINATES = ("window", "record", "start", "end")
BUCKET = ("bucket", "bucket_start", "bucket_end")
SUMS = tuple(
    column
    for prefix in SUBSETS
    for column in (f"{prefix}tokens", f"before_{prefix}sum", f"after_{prefix}sum")
)
CUT = ("before_cut_sum", "after_cut_sum", "cut_context")


def window_rows(sums: WindowSums, coordinates: list[dict] | None = None) -> list[dict]:
    """The file's rows of one held-out set (without the `heldout` column); `coordinates`: per window its
    index, record, start, end (the evaluation's provenance "windows"), or None."""
    n_windows, n_buckets = sums.tokens[""].shape
    if coordinates is not None and len(coordinates) != n_windows:
        raise ValueError(f"{len(coordinates)} window coordinates for {n_windows} scored windows")
    rows = []
    for w in range(n_windows):
        where = coordinates[w] if coordinates else {"index": w}
        place = {
            "window": where["index"],
            "record": where.get("record", ""),
            "start": where.get("start", ""),
            "end": where.get("end", ""),
        }
        for b in range(n_buckets):
            row = place | {"bucket": b, "bucket_start": int(sums.before.starts[b])}
            row["bucket_end"] = int(sums.before.ends[b])
            for prefix in SUBSETS:
                row[f"{prefix}tokens"] = int(sums.tokens[prefix][w, b])
                row[f"before_{prefix}sum"] = float(sums.before.sums[prefix][w, b])
                row[f"after_{prefix}sum"] = float(sums.after.sums[prefix][w, b])
            last = b == n_buckets - 1 and sums.cut_before is not None and sums.cut_after is not None
            row["before_cut_sum"] = float(sums.cut_before[w]) if last else ""
            row["after_cut_sum"] = float(sums.cut_after[w]) if last else ""
            row["cut_context"] = sums.cut_context if last else ""
            rows.append(row)
    return rows


def sums_from_rows(rows: list[dict]) -> WindowSums:
    """The `WindowSums` of one held-out set's rows (as `window_rows` makes them or `read_windows` reads them:
    values may be strings), windows in the order of their first row."""
    windows = list(dict.fromkeys(str(row["window"]) for row in rows))
    n_buckets = len({int(row["bucket"]) for row in rows})
    if len(rows) != len(windows) * n_buckets:
        raise ValueError(f"{len(rows)} rows for {len(windows)} windows of {n_buckets} buckets: incomplete")
    order = sorted(rows, key=lambda row: (windows.index(str(row["window"])), int(row["bucket"])))

    def column(name: str, dtype: type) -> np.ndarray:
        return np.array([dtype(row[name]) for row in order]).reshape(len(windows), n_buckets)

    starts = column("bucket_start", int)[0]
    ends = column("bucket_end", int)[0]
    tokens = {prefix: column(f"{prefix}tokens", int).astype(np.int64) for prefix in SUBSETS}
    models = {
        model: BucketSums(starts, ends, tokens, {p: column(f"{model}_{p}sum", float) for p in SUBSETS})
        for model in ("before", "after")
    }
    last = [row for row in order if int(row["bucket"]) == n_buckets - 1]
    has_cut = all(str(row["before_cut_sum"]) != "" for row in last)
    cut = {
        model: np.array([float(row[f"{model}_cut_sum"]) for row in last]) if has_cut else None
        for model in ("before", "after")
    }
    context = int(last[0]["cut_context"]) if has_cut else 0
    return WindowSums(models["before"], models["after"], cut["before"], cut["after"], context)


def write_windows_csv(result: dict, path: Path) -> Path:
    """Write the rows of every held-out set of an evaluation `result` (each set's "window_rows")."""
    several = "sets" in result
    columns = (["heldout"] if several else []) + [*COORDINATES, *BUCKET, *SUMS, *CUT]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for name, one in result_sets(result):
        for row in one["window_rows"]:
            # repr: the shortest string that reads back as the same float64
            cells = {k: repr(v) if isinstance(v, float) else v for k, v in row.items()}
            writer.writerow(({"heldout": name} if several else {}) | cells)
    return write_atomic(path, out.getvalue())


def read_windows(path: str | Path) -> dict[str, WindowSums]:
    """The `WindowSums` of each held-out set in a `windows.csv`, by folder name ("" for a one-folder file);
    ValueError naming the file when it lacks a column or rows."""
    path = Path(path)
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in (*COORDINATES, *BUCKET, *SUMS, *CUT) if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a genomelm windows file (no column {', '.join(missing)})")
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path}: no rows")
    by_set: dict[str, list[dict]] = {}
    for row in rows:
        by_set.setdefault(row.get("heldout", ""), []).append(row)
    try:
        return {name: sums_from_rows(set_rows) for name, set_rows in by_set.items()}
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def recompute(path: str | Path) -> dict[str, dict]:
    """Every statistic of the evaluation from its `windows.csv` alone: per held-out set (by folder name, ""
    for one folder) its buckets, overall, context_cut and contrast, as in `buckets.json`."""
    return {name: summarise(sums) for name, sums in read_windows(path).items()}
