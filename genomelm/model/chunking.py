"""The seam through which training policy reaches the model's chunk loops.

Blocks that process a long sequence in chunks for memory (the dense MLP, the MoE, the indexer's KL term) call
each chunk as `self.chunk_runner(fn, *args)`. The model's default runs it directly; the trainer may replace it
(`genomelm.train.memory.set_chunk_recompute`) with activation recompute per chunk. The model itself never
decides to recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ChunkRunner = Callable[..., Any]


def run_directly(fn: Callable[..., Any], *args: Any) -> Any:
    """The default chunk runner: `fn(*args)`."""
    return fn(*args)
