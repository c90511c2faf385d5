"""genomelm: long-context genome language modelling.

Packages, each importing only those listed before it (`tests/test_layering.py` checks it):
- `genomelm.data`: genomes -> prepared windows (FASTA / 2bit reading, regions, the vocabulary);
- `genomelm.model`: GLM-5.3-Flash in plain PyTorch, checkpoints in Hugging Face layout; of `data`, only
  `genomelm.data.vocab`;
- `genomelm.parallel`: the model and a window over many processes (context, expert and data parallelism,
  FSDP2, sharded checkpoints, the local launcher);
- `genomelm.run`: the run core every command shares (settings, device and models, launchers, run folder lock
  and stop request, scoring, metrics, failures);
- `genomelm.train` and `genomelm.eval`, side by side: the training loop and step; scoring the model before and
  after training and the genomics read-outs;
- `genomelm.plan`: will a run fit, and how fast (it traces the training and scoring steps);
- `genomelm.commands`: one module per `genomelm <stage>`; `genomelm.cli`: the thin dispatcher;
- `genomelm.api`: the Python API, `genomelm.load(run_or_folder)` (imported when first called);
- `genomelm.resources`: where the shipped configs and demo genome are (imports nothing of genomelm).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from genomelm.api import GenomeModel


def load(
    path: str | Path, device: str | torch.device | None = None, seq: int | None = None, progress: bool = True
) -> GenomeModel:
    """A run folder, a checkpoint or an exported Hugging Face folder as a `genomelm.api.GenomeModel` (`score`,
    `embed`, `score_variants`); see `genomelm.api.load`."""
    from genomelm.api import load as load_model

    return load_model(path, device, seq, progress)
