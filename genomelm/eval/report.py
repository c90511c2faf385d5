"""Writers of an evaluation result: `buckets.json`, `buckets.csv` and the printed bucket table.

A result is the dict `genomelm.eval.command.evaluate_sets` builds; for one held-out folder: settings, buckets
(from `buckets.compare`), overall, context_cut, provenance. With several folders (`heldout=dirA,dirB`) it
is {settings, sets: [{name, **one-folder result}, ...], provenance}; `result_sets` gives the per-folder
results of either form. NaN (no tokens, fewer than 2 windows) is written as JSON null and as an empty CSV
cell.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

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
    """Write `text` to `path` through a temporary name in the same folder, then rename into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(result: dict, path: Path) -> Path:
    return write_atomic(path, json.dumps(jsonable(result), indent=2, allow_nan=False) + "\n")


def result_sets(result: dict) -> list[tuple[str, dict]]:
    """(name, one-folder result) per held-out folder, for a one-folder or a several-folder result."""
    if "sets" in result:
        return [(entry["name"], entry) for entry in result["sets"]]
    return [(Path(str(result["provenance"].get("data_dir", "heldout"))).name, result)]


def csv_columns(several: bool = False) -> list[str]:
    """One CSV row per bucket (and held-out folder, first column `heldout`, when there are several): its
    positions, each model's statistics, and the relative changes."""
    columns = (["heldout"] if several else []) + ["bucket", "start", "end"]
    for prefix in SUBSETS:
        columns += [f"{model}_{prefix}{stat}" for model in ("before", "after") for stat in STATS]
        columns.append(f"{prefix}change")
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
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return write_atomic(path, out.getvalue())


def format_number(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _pct(value: float | None) -> str:
    return format_number(None if value is None else 100 * value, "+.2f") + ("%" if value is not None else "")


def format_table(result: dict) -> str:
    """Fixed-width text table: one line per bucket, the overall line, and the context-cut numbers; for several
    held-out folders, their buckets side by side (`format_side_by_side`)."""
    if "sets" in result:
        return format_side_by_side(result)
    header = (
        f"{'bucket':>6} {'context (kb)':>15} {'tokens':>11} {'before':>8} {'s.e.':>7} "
        f"{'after':>8} {'s.e.':>7} {'change':>8} {'repeat':>8} {'unmasked':>8}"
    )
    lines = [header, "-" * len(header)]
    for i, b in enumerate(result["buckets"]):
        span = f"{b['start'] / 1000:.1f}-{b['end'] / 1000:.1f}"
        before, after = b["before"], b["after"]
        lines.append(
            f"{i:>6} {span:>15} {after['tokens']:>11} {format_number(before['loss'], '.4f'):>8} "
            f"{format_number(before['se'], '.4f'):>7} {format_number(after['loss'], '.4f'):>8} "
            f"{format_number(after['se'], '.4f'):>7} {_pct(b['change']):>8} {_pct(b['repeat_change']):>8} "
            f"{_pct(b['unmasked_change']):>8}"
        )
    o = result["overall"]
    lines.append("-" * len(header))
    lines.append(
        f"{'all':>6} {'':>15} {o['tokens']:>11} {format_number(o['loss_before'], '.4f'):>8} {'':>7} "
        f"{format_number(o['loss_after'], '.4f'):>8} {'':>7} {_pct(o['change']):>8} "
        f"{_pct(o['repeat_change']):>8} {_pct(o['unmasked_change']):>8}"
    )
    cut = result.get("context_cut")
    if cut:
        lines.append("")
        lines.append(
            f"context cut: positions {cut['start']}-{cut['end']} scored with only the preceding "
            f"{cut['context']} tokens as context"
        )
        for model in ("before", "after"):
            full, cut_loss = format_number(cut[model]["full"], ".4f"), format_number(cut[model]["cut"], ".4f")
            lines.append(
                f"  {model:<6} full context {full}  cut {cut_loss}  ({_pct(cut[model]['cut_change'])})"
            )
        lines.append(
            f"  change after vs before: full context {_pct(cut['change_full'])}, "
            f"cut context {_pct(cut['change_cut'])}"
        )
    return "\n".join(lines)


def _side_cell(before: float | None, after: float | None, change: float | None) -> str:
    return f" | {format_number(before, '.4f'):>8} {format_number(after, '.4f'):>8} {_pct(change):>8}"


def format_side_by_side(result: dict) -> str:
    """Several held-out folders: one line per bucket with each folder's loss before and after and the change,
    the overall line, and each folder's context-cut numbers."""
    sets = result_sets(result)
    head = f"{'bucket':>6} {'context (kb)':>15}"
    width = len(_side_cell(0.0, 0.0, 0.0)) - 3  # the three columns of one folder
    lines = [head + "".join(f" | {name[-width:]:^{width}}" for name, _ in sets)]
    lines.append(" " * len(head) + f" | {'before':>8} {'after':>8} {'change':>8}" * len(sets))
    lines.append("-" * len(lines[0]))
    for i, bucket in enumerate(sets[0][1]["buckets"]):
        span = f"{bucket['start'] / 1000:.1f}-{bucket['end'] / 1000:.1f}"
        rows = [one["buckets"][i] for _, one in sets]
        cells = [_side_cell(row["before"]["loss"], row["after"]["loss"], row["change"]) for row in rows]
        lines.append(f"{i:>6} {span:>15}" + "".join(cells))
    lines.append("-" * len(lines[0]))
    overall = [one["overall"] for _, one in sets]
    cells = [_side_cell(o["loss_before"], o["loss_after"], o["change"]) for o in overall]
    lines.append(f"{'all':>6} {'':>15}" + "".join(cells))
    lines.append("")
    for name, one in sets:
        lines.append(
            f"{name}: {one['settings']['windows']} windows, {one['overall']['tokens']:,} tokens, "
            f"from {one['provenance']['data_dir']}"
        )
        cut = one.get("context_cut")
        if cut:
            lines.append(
                f"  context cut (positions {cut['start']}-{cut['end']} with {cut['context']} tokens "
                f"of context): change after vs before {_pct(cut['change_full'])} with full context, "
                f"{_pct(cut['change_cut'])} cut"
            )
    return "\n".join(lines)
