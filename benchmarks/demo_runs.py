"""The demo's training as a benchmark case: `train_demo` runs `genomelm train configs/train/demo.yaml` with
extra settings in a run folder of its own and reads back its losses (`benchmarks/optimizers.py`,
`benchmarks/low_precision.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from genomelm.run.metrics import HELDOUT_LOSS

ROOT = Path(__file__).resolve().parents[1]


def train_demo(name: str, settings: list[str], steps: int, runs: Path) -> dict:
    """Train the demo for `steps` with `settings` as run `name` under `runs` (held-out loss scored at the
    last step, no W&B, never resumed): its per-step losses ("curve"), the mean of the last 5 ("train"), the
    held-out loss ("heldout") and the wall time ("seconds")."""
    command = [
        sys.executable,
        "-m",
        "genomelm.cli",
        "train",
        str(ROOT / "configs/train/demo.yaml"),
        f"run={name}",
        f"runs_dir={runs}",
        f"results_dir={runs / 'results'}",
        f"steps={steps}",
        f"eval_every={steps}",
        f"save_every={steps}",
        "wandb=disabled",
        "resume=never",
        *settings,
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    heldout = [row[HELDOUT_LOSS] for row in rows if HELDOUT_LOSS in row]
    return {
        "curve": losses,
        "train": sum(losses[-5:]) / len(losses[-5:]),
        "heldout": heldout[-1],
        "seconds": time.perf_counter() - started,
    }
