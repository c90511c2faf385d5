"""`runs/<run>/config.yaml`: the run's resolved settings, readable and loadable as a run config.

Training writes it when a run starts (or continues), once its inputs are checked and before its first step
(`genomelm.run.metrics.MetricsLog`, on the output rank): the settings of every group as `TrainConfig.to_dict`
gives them, `steps` resolved from `epochs`, so `genomelm train runs/<run>/config.yaml` continues the run
(resume=auto) with the same settings. A run refused before it starts writes none. Relative paths in it
(data, model, runs_dir, results_dir) are relative to the folder the run was started from, which its header
names.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from genomelm.run.config import TrainConfig

SETTINGS_FILE = "config.yaml"


def write_run_settings(config: TrainConfig) -> Path:
    """Write `config` to `runs/<run>/config.yaml` through a temporary file renamed into place (a reader sees
    the old file or the new one, never half of one)."""
    path = config.run_dir / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [
        "# The resolved settings of this run, written by `genomelm train` at its start.",
        f"# started in: {Path.cwd()} (relative paths below are relative to it)",
    ]
    header.append(f"# continue the run: genomelm train {path}")
    text = "\n".join(header) + "\n" + yaml.safe_dump(config.to_dict(), sort_keys=False)
    temporary = path.with_name(f".{SETTINGS_FILE}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
