"""Which device and which model a run uses: one home for what training, evaluation and the probe share.

- `run_device()`: this process's device (its launcher's GPU, else the CPU);
- `model_config_of(model)`: a preset name or a checkpoint folder -> `ModelConfig`, without loading weights;
- `base_model_path` / `model_pair`: the run's model before training and after it (`genomelm.run.scoring`
  reads them for scoring).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
from torch import Tensor

from genomelm.model import ModelConfig
from genomelm.model.config import is_preset
from genomelm.parallel.checkpoint import Checkpointer, is_sharded, verify_checkpoint
from genomelm.parallel.checkpoint_holds import hold
from genomelm.run.config import TrainConfig


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
    """The before/after models: explicit ones, else the run's base model and its newest checkpoint: the step
    folder of a sharded one (read directly; its ranks verify it as they read it), the Hugging Face copy of a
    one-process one. That checkpoint is held for the life of this process (`Checkpointer.hold`), so a run
    that still trains does not prune it while it is scored."""
    if after is None:
        after = str(_held_newest_model(Checkpointer(config.run_dir)))
        if is_preset(config.model) or Path(config.model, "config.json").exists():
            _check_run_model(config, after)
    return (base_model_path(config) if before is None else before), after


def _check_run_model(config: TrainConfig, checkpoint: str) -> None:
    """Refuse `model=` naming another architecture than the run's newest checkpoint `checkpoint` has: the
    pair is the run's own models, so a different `model=` would be ignored without a word."""
    wanted, found = model_config_of(config.model), model_config_of(checkpoint)
    if _architecture(wanted) != _architecture(found):
        raise ModelChoiceError(
            f"model={config.model} is not the model run {config.run} trained ({checkpoint} is another "
            "architecture): the before/after pair is the run's own models, so leave model= as the run had "
            "it, or score other models with --before PATH --after PATH"
        )


def _architecture(config: ModelConfig) -> dict:
    """A model config's fields, less the Hugging Face file's extras (which a saved copy adds)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "extra"}


def _held_newest_model(checkpointer: Checkpointer, tries: int = 5) -> Path:
    """`_newest_intact_model`, held (`genomelm.parallel.checkpoint_holds`): chosen again if a run saving
    meanwhile pruned it before the hold was taken."""
    for _attempt in range(tries):
        chosen = _newest_intact_model(checkpointer)
        step_dir = chosen if is_sharded(chosen) else chosen.parent
        taken = hold(step_dir)
        if step_dir in checkpointer.complete():  # not pruned before the hold was taken
            return chosen
        taken.unlink(missing_ok=True)
    raise ModelChoiceError(
        f"the checkpoints of {checkpointer.run_dir} were pruned as fast as one was chosen: run again, or "
        "pass --after PATH"
    )


def _newest_intact_model(checkpointer: Checkpointer) -> Path:
    """The newest checkpoint to score: a sharded one's step folder, or the Hugging Face copy of the newest
    one-process checkpoint whose model files match their checksums (a damaged one is skipped with a warning
    naming its files)."""
    found = checkpointer.complete()
    if not found:
        raise ModelChoiceError(
            f"no trained checkpoint in {checkpointer.run_dir}; run `make train` first (or pass --after PATH)"
        )
    if is_sharded(found[-1]):
        return found[-1]
    damaged = []
    for checkpoint in reversed(found):
        if is_sharded(checkpoint):
            continue
        problems = verify_checkpoint(checkpoint, prefix="model/")
        if not problems:
            if damaged:
                warnings.warn(f"damaged, using {checkpoint} instead: {'; '.join(damaged)}", stacklevel=3)
            return checkpoint / "model"
        damaged += problems
    raise ModelChoiceError(f"every trained model in {checkpointer.root} is damaged: {'; '.join(damaged)}")


def device_rows(rows: list[Tensor], device: torch.device) -> list[Tensor]:
    """A window's rows [S] (ids, labels, weights) as model rows [1, S] on `device`: on a GPU through pinned
    host memory, so the copies are queued without stopping the host."""
    if device.type != "cuda":
        return [t[None].to(device) for t in rows]
    return [t[None].pin_memory().to(device, non_blocking=True) for t in rows]
