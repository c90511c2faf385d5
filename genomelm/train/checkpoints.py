"""Training checkpoints: written to a temporary folder and renamed into place, so a kill -9 at any moment
leaves the last complete checkpoint readable.

Layout of `runs/<run>/checkpoints/step-0000100/`:
- `model/`: the model in Hugging Face layout (`genomelm.model.load_model` and transformers read it);
- `trainer.pt`: optimizer, scheduler, RNG and data-order state, the step, the run config.
A run of more than one process writes sharded checkpoints instead (`genomelm.parallel.sharded_checkpoint`:
`state/` holds each rank's shard); both kinds count here once complete.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genomelm.model import save_model
from genomelm.model.config import PRESET_DIR
from genomelm.train.config import TrainConfig

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_preset(model: str | None) -> bool:
    return bool(model) and not Path(model).exists() and (PRESET_DIR / f"{model}.yaml").exists()


def base_model_path(config: TrainConfig) -> str:
    """The model before training: the configured checkpoint folder, or for a preset the run's saved init."""
    if is_preset(config.model):
        return str(config.run_dir / "init")
    return config.model


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders of interrupted writes are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "trainer.pt").exists()
        and ((p / "model" / "config.json").exists() or (p / "state" / ".metadata").exists())
    ]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    keep: int) -> Path:
    """Write `step-<step>` atomically and prune to the newest `keep` checkpoints."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{step:07d}"
    tmp = root / f"{TMP_PREFIX}{STEP_PREFIX}{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, tmp / "model")
    torch.save(trainer_state, tmp / "trainer.pt")
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clean_interrupted_writes(run_dir: Path) -> list[Path]:
    """Remove temporary folders left by a killed checkpoint write; returns what was removed."""
    root = checkpoint_dir(run_dir)
    removed = [p for p in root.glob(f"{TMP_PREFIX}*")] if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
