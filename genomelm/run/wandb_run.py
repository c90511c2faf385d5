"""Which Weights & Biases run a genomelm run logs to: project, entity and group from the settings (`log.*`)
or W&B's own environment variables, and the run's id, recorded in `runs/<run>/wandb_id`: a run continuing
from a checkpoint continues its W&B run, a fresh run (even under an old name) starts a new one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from genomelm.run.config import TrainConfig

WANDB_ID_FILE = "wandb_id"
DEFAULT_PROJECT = "genomelm"


def wandb_run_id(run_dir: Path, resumed_step: int) -> tuple[str, bool]:
    """(W&B run id, whether it continues an earlier one): the recorded id when the run continues from a
    checkpoint (`resumed_step` > 0), else a new one ($WANDB_RUN_ID when set), recorded for the next resume
    through a temporary file renamed into place."""
    path = Path(run_dir) / WANDB_ID_FILE
    if resumed_step > 0 and path.is_file() and path.read_text().strip():
        return path.read_text().strip(), True
    run_id = os.environ.get("WANDB_RUN_ID") or secrets.token_hex(6)  # W&B ids: lower case letters, digits
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{WANDB_ID_FILE}.{os.getpid()}.tmp")
    temporary.write_text(run_id + "\n")
    os.replace(temporary, path)
    return run_id, False


def wandb_init_args(config: TrainConfig, resumed_step: int) -> dict[str, Any]:
    """The keyword arguments of `wandb.init` for the run `config` continuing at `resumed_step` (0: fresh).
    An entity or group left unset is passed as None, which W&B fills from $WANDB_ENTITY / $WANDB_RUN_GROUP."""
    run_id, continues = wandb_run_id(config.run_dir, resumed_step)
    log = config.log
    return {
        "project": log.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        "entity": log.wandb_entity,
        "group": log.wandb_group,
        "name": config.run,
        "dir": str(config.run_dir),
        "mode": log.wandb,
        "config": config.to_dict(),
        "id": run_id,
        "resume": "allow" if continues else None,
    }
