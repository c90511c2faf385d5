"""Per-step metrics: a JSONL file per run, Weights & Biases (offline by default), memory readings."""

from __future__ import annotations

import json
import os
import resource
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch

from genomelm.train.config import TrainConfig


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`. A torn last line (a write cut short: disk full, a kill) is skipped with
    a warning naming the file; a damaged line before the last is an error naming the file and line."""
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
            warnings.warn(
                f"{path}: skipped its torn last line (a write cut short): {line[:60]!r}", stacklevel=2
            )
    return rows


class MetricsLog:
    """Appends one JSON object per step to `runs/<run>/metrics.jsonl` and mirrors it to wandb."""

    def __init__(self, config: TrainConfig, resumed_step: int) -> None:
        self.path = config.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step == 0 and self.path.exists():
            self.path.unlink()
        elif self.path.exists():  # drop the rows of steps the resumed run will redo, and a torn last line
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= resumed_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.wandb_run = None
        if config.log.wandb != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb_run = wandb.init(
                project="genomelm",
                name=config.run,
                dir=str(config.run_dir),
                mode=config.log.wandb,
                config=config.to_dict(),
                resume="allow",
                id=f"{config.run}",
            )

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float, bool))}
            self.wandb_run.log(flat, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
