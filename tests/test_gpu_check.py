"""benchmarks/gpu_check.py keeps running: its --cpu-smoke mode (the GPU run's code at tiny sizes, on the CPU)
passes, writes its table as JSON, skips what its budget does not fit, and its analytic FLOP count equals
FlopCounterMode's where the model runs plain torch ops (less the triangular solves FlopCounterMode cannot
see, within the script's FLOP_TOLERANCE)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.train.memory import LayerRunner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_check(monkeypatch) -> ModuleType:
    """The script as a module importable by name (its dp x ep ranks unpickle their function from it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_check")


def test_analytic_flops_equal_flop_counter_on_plain_torch(gpu_check: ModuleType) -> None:
    """`tiny` without recompute at 1536 tokens: a dense MLP layer, and indexer blocks that score only the
    pools they see (1536 tokens is 384 pools, beyond TOPK_SORT_RATIO x the 4 pools taken)."""
    config = ModelConfig.preset("tiny")
    options = RunOptions(kda_backend="torch", **gpu_check.TORCH_PATHS)
    torch.manual_seed(0)
    model = GlmForCausalLM.from_config(config, options)
    ids = gpu_check.dna(1536, torch.device("cpu"))
    with FlopCounterMode(display=False, custom_mapping=gpu_check.FLOP_FORMULAS) as counter:
        gpu_check.forward_backward(model, ids, LayerRunner(recompute=False, offload=False), bf16=False)
    parts = gpu_check.step_flops(config, options, 1536, recompute=False)
    visible = sum(parts.values()) - gpu_check.unseen_flops(parts, "torch")
    assert parts["dense mlp"] > 0 and parts["kda triangular solves"] > 0
    assert counter.get_total_flops() == pytest.approx(visible, rel=gpu_check.FLOP_TOLERANCE)


@pytest.mark.slow
def test_gpu_check_cpu_smoke(gpu_check: ModuleType, tmp_path: Path, capsys) -> None:
    path = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--cpu-smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["complete"] and report["versions"]["fla"] == "not installed"
    header = out.splitlines()[0]
    assert header.startswith("genomelm gpu_check on the CPU (smoke sizes), torch ")
    assert f", triton {gpu_check.package_version('triton')}, fla not installed" in header
    rows = {row["check"]: row for row in report["rows"]}
    kernels = [f"{title} at 64 tokens" for title, _ in gpu_check.KERNEL_CHECKS]
    torch_slice = "slice at 512 tokens (fwd+bwd, recompute, bf16, KDA torch, torch paths)"
    updates = [f"{name} update: compiled vs eager, [4096, 8192]" for name in ("adamw8bit", "adamw_bf16")]
    experts = [
        f"expert GEMM {name} vs emulation and bf16 (4096 x 4096, 8 experts)"
        for name in ("fp8_rowwise", "mxfp8")
    ]
    assert list(rows) == [
        "fla chunk_kda vs torch KDA (64 heads x 128)",
        *kernels,
        torch_slice,
        "slice at 512 tokens with the kernels vs the torch paths (KDA torch, kernels)",
        "slice routes (with the kernels)",
        "roofline vs measured by layer kind (slice at 512 tokens, kernels)",
        "bf16 vs fp32 step (small, torch KDA)",
        "offload vs no offload (small, bf16)",
        "dp 2 x ep 2 step (tiny, fp32, FSDP2, gloo)",
        *updates,
        *experts,
    ]
    for name, row in rows.items():  # every row is in the printed table
        assert f"| {name} | " in out and f" | {row['result']} |" in out
    for name in updates:  # tests/test_optimizers.py holds the compiled update to the eager one on the CPU
        assert rows.pop(name)["result"] == "skipped: no CUDA (the compiled update is the GPU's path)"
    for name in experts:  # tests/test_expert_precision.py holds the emulation to bf16 on the CPU
        skipped = "skipped: no CUDA (torchao's kernels; tests/test_expert_precision.py holds the emulation)"
        assert rows.pop(name)["result"] == skipped
    fla, *others = rows.values()
    assert fla["result"] == "skipped: no CUDA (fla's kernels run on GPUs only)"
    assert all(row["status"] == "ok" for row in others), [row["result"] for row in others]
    for name in kernels:  # the kernels ran in the interpreter against their torch paths
        assert rows[name]["details"]["max_rel_error"] < 1e-4, rows[name]["result"]
    measured = rows[torch_slice]
    flops = measured["details"]
    assert flops["flops_unseen"] == flops["flops_by_part"]["kda triangular solves"] > 0
    visible = flops["flops_analytic"] - flops["flops_unseen"]
    assert flops["flops_flop_counter"] == pytest.approx(visible, rel=gpu_check.FLOP_TOLERANCE)
    assert measured["tokens_per_s"] > 0 and measured["seconds"] > 0

    # 1 s of budget: the first check runs (nothing to estimate from yet) and overruns it (a few seconds here),
    # so every later one is skipped with its estimate (the routes because no slice ran), --long's included
    path = tmp_path / "budget.json"
    assert gpu_check.main(["--cpu-smoke", "--long", "--budget-s", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert rows[0]["result"] == "skipped: no CUDA (fla's kernels run on GPUs only)"
    spent = [i for i, row in enumerate(rows) if row["result"].startswith("skipped: budget: ~")]
    assert spent, [row["result"] for row in rows]
    assert all(row["status"] == "ok" for row in rows[1 : spent[0]])  # ran while budget was left
    for row in rows[spent[0] :]:  # then nothing runs: skipped by the budget, or for want of what did not run
        assert row["status"] == "skipped", row["result"]
        if row["result"].startswith("skipped: budget: ~"):
            assert row["details"]["estimate_s"] > row["details"]["left_s"]
    assert rows[-2]["check"] == "slice at 1,024 tokens (fwd+bwd, recompute, bf16, KDA torch, torch paths)"
    assert {len(rows) - 2, len(rows) - 1} <= set(spent)  # --long's slices
    out = capsys.readouterr().out
    assert "| slice at 2,048 tokens (fwd+bwd, recompute, bf16, KDA torch, torch paths) | 2,048 | - |" in out
