"""Writers of an evaluation result: `buckets.json`, `buckets.csv` and the printed bucket table.

A result is the dict `genomelm.eval.command.evaluate` builds: settings, buckets (from
`buckets.compare`), overall, context_cut, provenance. NaN (no tokens, fewer than 2 windows) is
written as JSON null and as an empty CSV cell.
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


def csv_columns() -> list[str]:
    """One CSV row per bucket: its positions, each model's statistics, and the relative changes."""
    columns = ["bucket", "start", "end"]
    for prefix in SUBSETS:
        columns += [f"{model}_{prefix}{stat}" for model in ("before", "after") for stat in STATS]
        columns.append(f"{prefix}change")
    return columns


def write_csv(result: dict, path: Path) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=csv_columns(), lineterminator="\n")
    writer.writeheader()
    for i, bucket in enumerate(jsonable(result["buckets"])):
        row: dict[str, Any] = {"bucket": i, "start": bucket["start"], "end": bucket["end"]}
        for prefix in SUBSETS:
            for model in ("before", "after"):
                row.update({f"{model}_{prefix}{stat}": bucket[model][prefix + stat] for stat in STATS})
            row[f"{prefix}change"] = bucket[prefix + "change"]
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return write_atomic(path, out.getvalue())


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _pct(value: float | None) -> str:
    return _num(None if value is None else 100 * value, "+.2f") + ("%" if value is not None else "")


def format_table(result: dict) -> str:
    """Fixed-width text table: one line per bucket, the overall line, and the context-cut numbers."""
    header = (f"{'bucket':>6} {'context (kb)':>15} {'tokens':>11} {'before':>8} {'s.e.':>7} "
              f"{'after':>8} {'s.e.':>7} {'change':>8} {'repeat':>8} {'unmasked':>8}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for i, b in enumerate(result["buckets"]):
        span = f"{b['start'] / 1000:.1f}-{b['end'] / 1000:.1f}"
        lines.append(
            f"{i:>6} {span:>15} {b['after']['tokens']:>11} {_num(b['before']['loss'], '.4f'):>8} "
            f"{_num(b['before']['se'], '.4f'):>7} {_num(b['after']['loss'], '.4f'):>8} "
            f"{_num(b['after']['se'], '.4f'):>7} {_pct(b['change']):>8} {_pct(b['repeat_change']):>8} "
            f"{_pct(b['unmasked_change']):>8}"
        )
    o = result["overall"]
    lines.append("-" * len(header))
    lines.append(
        f"{'all':>6} {'':>15} {o['tokens']:>11} {_num(o['loss_before'], '.4f'):>8} {'':>7} "
        f"{_num(o['loss_after'], '.4f'):>8} {'':>7} {_pct(o['change']):>8} {_pct(o['repeat_change']):>8} "
        f"{_pct(o['unmasked_change']):>8}"
    )
    cut = result.get("context_cut")
    if cut:
        lines.append("")
        lines.append(f"context cut: positions {cut['start']}-{cut['end']} scored with only the preceding "
                     f"{cut['context']} tokens as context")  # fmt: skip
        for model in ("before", "after"):
            lines.append(f"  {model:<6} full context {_num(cut[model]['full'], '.4f')}  "
                         f"cut {_num(cut[model]['cut'], '.4f')}  ({_pct(cut[model]['cut_change'])})")  # fmt: skip
        lines.append(f"  change after vs before: full context {_pct(cut['change_full'])}, "
                     f"cut context {_pct(cut['change_cut'])}")  # fmt: skip
    return "\n".join(lines)
