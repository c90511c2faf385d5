"""benchmarks/kernel_memory.py: the indexer's and the sparse attention's own transient at a context-parallel
rank, torch paths against the Triton kernels' fake implementations (what the planner traces)."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_hold_a_fraction_of_the_torch_paths_transient(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    kernel_memory = importlib.import_module("kernel_memory")
    indexer, attention = kernel_memory.measure(queries=2048, window=32768)
    # the torch indexer's [128 queries, 32 heads, 8192 pools] fp32 block is 128 MiB; the kernel's scores of
    # one span (its block: all 1,024 queries of the span, under its 256 MiB bound) [1024, 8192] fp32, 32 MiB
    assert indexer.torch_transient > 0.12 and indexer.kernel_transient < 0.07
    # the torch core's gathered latents and probabilities per block, against nothing beyond what both hold
    assert attention.torch_transient > 0.3 and attention.kernel_transient < 0.01
    assert attention.kernel_gib >= attention.held_gib * 0.99  # the fp32 accumulator is counted, not hidden
