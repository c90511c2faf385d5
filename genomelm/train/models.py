"""Which device and which model a run uses: one home for what training, evaluation and the probe share.

- `run_device()`: this process's device (its launcher's GPU, else the CPU);
- `model_config_of(model)`: a preset name or a checkpoint folder -> `ModelConfig`, without loading weights;
- `base_model_path` / `model_pair`: the run's model before training and after it;
- `load_scoring_model`: a model read for scoring windows, split over the context-parallel group when there is
  one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from genomelm.model import ModelConfig, load_model
from genomelm.model.config import is_preset
from genomelm.parallel.checkpoint import Checkpointer, verify_checkpoint
from genomelm.parallel.context import apply_context_parallel
from genomelm.parallel.training import ContextParallelScorer, ContextRun
from genomelm.train.config import TrainConfig


class ModelChoiceError(ValueError):
    """A before/after model that does not exist or cannot be read as it is; the message names the fix."""


def run_device() -> torch.device:
    """The GPU this process's launcher picked (`cuda:<current>`), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_config_of(model: str) -> ModelConfig:
    """The architecture of a preset (`tiny`, `demo`, `glm-5.3-flash`, ...) or of a checkpoint folder."""
    return ModelConfig.preset(model) if is_preset(model) else ModelConfig.from_file(model)


def base_model_path(config: TrainConfig) -> str:
    """The model before training: the configured checkpoint folder, or for a preset the run's saved init."""
    if is_preset(config.model):
        return str(config.run_dir / "init")
    return config.model


def model_pair(config: TrainConfig, before: str | None = None, after: str | None = None) -> tuple[str, str]:
    """The before/after model folders: explicit ones, else the run's base model and its newest checkpoint's
    Hugging Face copy."""
    if after is None:
        after = str(_newest_intact_model(Checkpointer(config.run_dir)))
    return (base_model_path(config) if before is None else before), after


def _newest_intact_model(checkpointer: Checkpointer) -> Path:
    """The Hugging Face copy of the newest checkpoint whose model files match their checksums; a damaged one
    is skipped with a warning naming its files."""
    found = checkpointer.complete()
    if not found:
        raise ModelChoiceError(
            f"no trained checkpoint in {checkpointer.run_dir}; run `make train` first (or pass --after PATH)"
        )
    if not (found[-1] / "model" / "config.json").exists():
        raise ModelChoiceError(
            f"{found[-1]} is a sharded checkpoint without its Hugging Face copy; run `genomelm export "
            f"{found[-1]} {found[-1] / 'model'}` (or pass --after PATH)"
        )
    damaged = []
    for checkpoint in reversed(found):
        if not (checkpoint / "model" / "config.json").exists():
            continue
        problems = verify_checkpoint(checkpoint, prefix="model/")
        if not problems:
            if damaged:
                warnings.warn(f"damaged, using {checkpoint} instead: {'; '.join(damaged)}", stacklevel=3)
            return checkpoint / "model"
        damaged += problems
    raise ModelChoiceError(f"every trained model in {checkpointer.root} is damaged: {'; '.join(damaged)}")


def load_scoring_model(path: str, config: TrainConfig) -> nn.Module:
    """The model at `path` for scoring whole windows, with the run's `model_options`, on `run_device()`: as
    loaded in one process, or inside a launched group a `ContextParallelScorer` over this rank's shard (every
    rank gets the whole window's per-token losses)."""
    model = load_model(path, options=config.model_options, device=run_device())
    context = ContextRun.from_environment(config.parallel.cp_layout)
    if context is None:
        return model

    apply_context_parallel(model, context.group, context.kind)
    return ContextParallelScorer(model, context)
