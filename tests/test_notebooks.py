"""The notebooks run headless on evaluation and training outputs, and are committed without outputs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from genomelm.eval.command import evaluate, write_outputs
from genomelm.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


class PositionLoss(torch.nn.Module):
    """Per-token loss scale * (1 + 1 / (t + 1)) + 0.1 * token: falls with position t, varies by window."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(scale))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        t = torch.arange(input_ids.shape[1], dtype=torch.float32)
        nll = self.scale * (1 + 1 / (t + 1)) + 0.1 * input_ids.float()
        return torch.where(labels == -100, torch.zeros_like(nll), nll)


@pytest.fixture(scope="module")
def demo_outputs(tmp_path_factory) -> tuple[Path, Path]:
    """(buckets.json, metrics.jsonl) of a small synthetic run."""
    folder = tmp_path_factory.mktemp("demo")
    g = torch.Generator().manual_seed(0)
    windows = []
    for i in range(3):
        ids = torch.randint(0, 4, (64,), generator=g)
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        windows.append({"input_ids": ids, "labels": labels, "softmask": torch.rand(64, generator=g) < 0.5,
                        "record": "chrT", "start": 64 * i, "end": 64 * (i + 1)})  # fmt: skip
    models = {"init": PositionLoss(1.4), "step-10": PositionLoss(1.2)}
    config = TrainConfig(run="demo", seq="64", bucket=16)
    provenance = {"data_dir": "synthetic", "manifest": "synthetic/manifest.json", "windows": []}
    write_outputs(evaluate(config, windows, models.__getitem__, "init", "step-10", provenance), folder)
    metrics = folder / "metrics.jsonl"
    with open(metrics, "w") as handle:
        for step in range(1, 21):
            skipped = step == 7
            handle.write(json.dumps({
                "step": step, "loss": math.nan if skipped else 1.4 - 0.01 * step, "lr": 1e-5 * min(1, step / 5),
                "grad_norm": 1.0, "tokens_per_s": 900.0 + step, "peak_device_mem_gb": 0.0, "host_rss_gb": 1.5,
                "skipped": skipped,
            }) + "\n")  # fmt: skip
    return folder / "buckets.json", metrics


def kernel_manager(folder: Path) -> KernelManager:
    """A kernel of this interpreter (the venv's), whatever `python3` kernelspec the machine has."""
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "genomelm", "language": "python"}))
    return KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))


def run_notebook(name: str, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", km=kernel_manager(tmp_path),
                            resources={"metadata": {"path": str(NOTEBOOKS)}})  # fmt: skip
    client.execute()
    return nb


def outputs(nb: nbformat.NotebookNode, kind: str) -> list[str]:
    """All `text/plain`-like stream texts (kind 'text') or PNG payloads (kind 'png') of the run notebook."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "text" and out.get("output_type") == "stream":
                found.append(out["text"])
            if kind == "png" and "image/png" in out.get("data", {}):
                found.append(out["data"]["image/png"])
    return found


@pytest.fixture
def notebook_env(monkeypatch, demo_outputs) -> None:
    buckets, metrics = demo_outputs
    monkeypatch.setenv("BUCKETS", str(buckets))
    monkeypatch.setenv("METRICS", str(metrics))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports genomelm even without an install


@pytest.mark.usefixtures("notebook_env")
def test_loss_by_position_notebook(tmp_path) -> None:
    nb = run_notebook("loss_by_position.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "run demo, 3 windows of 64 tokens, 4 buckets of 16" in text
    assert "after:  step-10" in text and "context cut" in text
    assert len(outputs(nb, "png")) == 2


@pytest.mark.usefixtures("notebook_env")
def test_training_curves_notebook(tmp_path) -> None:
    nb = run_notebook("training_curves.ipynb", tmp_path)
    assert "20 steps (1..20), 1 skipped" in "".join(outputs(nb, "text"))
    assert len(outputs(nb, "png")) == 1


@pytest.mark.parametrize("name", ["loss_by_position.ipynb", "training_curves.ipynb"])
def test_committed_notebooks_have_no_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
