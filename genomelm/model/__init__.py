"""GLM-5.3-Flash in plain PyTorch: configuration, model, and (from `.checkpoint`) loading and saving."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, RunOptions
from .model import GlmForCausalLM

__all__ = ["GlmForCausalLM", "ModelConfig", "RunOptions", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    """`load_model` and `save_model` come from `.checkpoint`, imported on first use."""
    if name in ("load_model", "save_model"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
