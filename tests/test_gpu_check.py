"""benchmarks/gpu_check.py keeps running: its --cpu-smoke mode passes on the CPU at small shapes."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_smoke(capsys) -> None:
    script = runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"), run_name="gpu_check")
    assert script["main"](["--cpu-smoke", "--lengths", "256"]) == 0
    table = capsys.readouterr().out
    assert "| fla chunk_kda vs torch KDA | not run (no CUDA) | not run |" in table
    assert "offload vs no offload (bf16)" in table and "MISMATCH" not in table
    assert "| slice route table: no dense S x S layer | dense layers: none | ok |" in table
