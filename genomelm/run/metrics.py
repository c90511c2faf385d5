"""Per-step metrics: a JSONL file per run, Weights & Biases (offline by default), memory readings.

A step that evaluated the held-out windows (`eval_every`) also holds `heldout/loss` (nats/base over every
valid token) and one `heldout/bucket_<start>_<end>` per position bucket (positions [start, end) of the
window), each with its standard error across windows (`..._se`), and from the second evaluation on the paired
change since the previous one (`heldout/change`, `_low`, `_high`); on W&B each is a series, and the row's
loss-by-position figure (error bars: standard errors) is the image `heldout/loss_by_position`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from genomelm.data.errors import space_checked
from genomelm.run.config import TrainConfig
from genomelm.run.settings_file import write_run_settings
from genomelm.run.wandb_run import wandb_init_args

HELDOUT_LOSS = "heldout/loss"
EXPERT_LOAD_FILE = "expert_load.json"  # tokens routed per expert and MoE layer (`genomelm.train.balance`)
EXPERT_PLACEMENT_FILE = "expert_placement.json"  # the experts' placement by load (`genomelm.train.balance`)
SPACE_ADVICE = (
    "the run's newest checkpoint is intact: free space, and the same command continues (resume=auto)"
)
_BUCKET_KEY = re.compile(r"heldout/bucket_(\d+)_(\d+)")


def host_memory_gb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in GB."""
    current = psutil.Process().memory_info().rss / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux
    return current, peak


def device_peak_gb() -> float:
    """Peak device memory since the last reset (0 on the CPU, where host RSS is the number to read)."""
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 1e9
    torch.cuda.reset_peak_memory_stats()
    return peak


def read_metrics(path: Path, salvage: bool = False) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`. A torn last line (a write cut short: disk full, a kill) is skipped with
    a warning naming the file, or with `salvage` kept without one as the fields written before the tear,
    marked `"torn": true` (`salvaged_row`; skipped when not even its step was written); a damaged line
    before the last is an error naming the file and line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise ValueError(
                    f"{path}, line {number}: not a metrics row ({exc}); remove the line"
                ) from None
            salvaged = salvaged_row(line) if salvage else None
            if salvaged is not None:
                rows.append(salvaged)
            elif not salvage:
                warnings.warn(
                    f"{path}: skipped its torn last line (a write cut short): {line[:60]!r}", stacklevel=2
                )
    return rows


def salvaged_row(line: str) -> dict[str, Any] | None:
    """The fields of a torn row (one `json.dumps` cut short) up to the last whole one, with `"torn": True`;
    None when its step is not among them."""
    for match in reversed(list(re.finditer(r', "', line))):
        try:
            row = json.loads(line[: match.start()] + "}")
        except ValueError:
            continue
        return row | {"torn": True} if isinstance(row, dict) and "step" in row else None
    return None


def heldout_bucket_key(start: int, end: int) -> str:
    """The metrics key of the held-out loss of positions [start, end)."""
    return f"heldout/bucket_{start}_{end}"


def heldout_se_key(start: int, end: int) -> str:
    """The metrics key of the standard error (across windows) of the held-out loss of [start, end)."""
    return f"{heldout_bucket_key(start, end)}_se"


def heldout_buckets(record: dict[str, Any]) -> list[tuple[int, int, float]]:
    """(start, end, loss) of each held-out bucket of a metrics row, by position; [] for a row without."""
    found = [(_BUCKET_KEY.fullmatch(key), value) for key, value in record.items()]
    return sorted((int(m[1]), int(m[2]), float(value)) for m, value in found if m is not None)


def loss_by_position_image(buckets: list[tuple[int, int, float]], se: list[float], step: int) -> np.ndarray:
    """The held-out loss per bucket (`heldout_buckets`) of step `step`, with error bars of its standard
    errors `se` (NaN: none), against the bucket's midpoint (kb of context), drawn small: RGBA uint8 [H, W, 4]
    (no pyplot, so nothing global to close)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # only with W&B on
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3), dpi=80, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.subplots()
    midpoints, losses = [(s + e) / 2000 for s, e, _ in buckets], [loss for *_, loss in buckets]
    axes.errorbar(midpoints, losses, yerr=np.nan_to_num(np.asarray(se, float)), marker="o", ms=3, capsize=2)
    axes.set(
        xlabel="context (kb, bucket midpoint)",
        ylabel="held-out loss (nats/base)",
        title=f"held-out loss by position, step {step}",
    )
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


class MetricsLog:
    """Appends one JSON object per step to `runs/<run>/metrics.jsonl` and mirrors it to wandb.

    The file is never deleted: a run that continues from step N keeps the rows up to N and drops those of the
    steps it will run again, rewritten through a temporary file; a torn last row of a step up to N (not run
    again) keeps the fields written before the tear, marked torn. A full disk on an
    append stops the run with `DiskFull` (its last checkpoint intact)."""

    def __init__(self, config: TrainConfig, resumed_step: int) -> None:
        self.path = config.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_run_settings(config)  # runs/<run>/config.yaml: the settings the run (re)starts with
        if self.path.exists():
            rows = read_metrics(self.path, salvage=True)
            kept = [row for row in rows if row.get("step", 0) <= resumed_step]
            for row in (row for row in rows if row.get("torn")):
                # a step not run again keeps what was written of its row
                what = "its step runs again"
                if row in kept:
                    what = "kept its fields before the tear, marked torn"
                warnings.warn(
                    f"{self.path}: the torn last line (a write cut short) is the row of step {row['step']}: "
                    f"{what}",
                    stacklevel=2,
                )
            text = "".join(json.dumps(row) + "\n" for row in kept)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with space_checked(self.path, len(text), "the metrics kept on resume", SPACE_ADVICE):
                try:
                    tmp.write_text(text)
                    os.replace(tmp, self.path)
                finally:
                    tmp.unlink(missing_ok=True)
        self.wandb_run = None
        if config.log.wandb != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb_run = wandb.init(**wandb_init_args(config, resumed_step))

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with (
            space_checked(self.path, len(line), "a metrics row", SPACE_ADVICE),
            open(self.path, "a") as handle,
        ):
            handle.write(line)
        if self.wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float, bool))}
            buckets = heldout_buckets(record)
            if buckets:
                import wandb

                se = [record.get(heldout_se_key(s, e), float("nan")) for s, e, _ in buckets]
                image = loss_by_position_image(buckets, se, record["step"])
                flat["heldout/loss_by_position"] = wandb.Image(image)
            self.wandb_run.log(flat, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_expert_load(path: Path) -> dict[int, list[float]]:
    """The per-layer load of an `expert_load.json`, by MoE layer index; a ValueError naming the file when it
    is not one (torn or edited)."""
    try:
        counts = json.loads(Path(path).read_text())["counts"]
        return {int(k): list(v) for k, v in counts.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is not a routed-load file ({type(exc).__name__}: {str(exc)[:120]}): remove it (the "
            "run's next checkpoint writes it again), or give the imbalance: imbalance=<busiest/mean, e.g. "
            "1.5>"
        ) from None
