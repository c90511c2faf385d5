"""The notebooks run headless on evaluation and training outputs, and are committed without outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from genomelm.commands.data import main as data_main
from genomelm.commands.eval import main as eval_main
from genomelm.commands.probe import main as probe_main

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def kernel_manager(folder: Path) -> KernelManager:
    """A kernel of this interpreter (the venv's), whatever `python3` kernelspec the machine has."""
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "genomelm", "language": "python"})
    )
    return KernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)])
    )


def run_notebook(name: str, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        km=kernel_manager(tmp_path),
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
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


def demo_run(demo_outputs, results: Path) -> list[str]:
    """Arguments of `genomelm eval`/`probe` for the demo pipeline's run, writing into `results`."""
    provenance = json.loads(demo_outputs[0].read_text())["provenance"]
    return [
        "run=demo",
        "seq=128",
        "model=tiny",
        "bucket=16",
        f"data={provenance['data_dir']}",
        f"results_dir={results}",
        "--before",
        provenance["before_model"],
        "--after",
        provenance["after_model"],
    ]


@pytest.fixture(scope="module")
def copy_probe_json(demo_outputs, tmp_path_factory) -> Path:
    """`genomelm probe` on the demo pipeline's run."""
    results = tmp_path_factory.mktemp("probe")
    settings = ["probe_length=16", "probe_distances=16,32,64,128", "probe_windows=3"]
    assert probe_main([*demo_run(demo_outputs, results), *settings]) == 0
    return results / "demo" / "copy_probe.json"


@pytest.fixture(scope="module")
def two_set_buckets(demo_outputs, tmp_path_factory) -> Path:
    """`genomelm eval` of the demo run on its own held-out windows and on human DNA (hg38 fragments)."""
    root = tmp_path_factory.mktemp("two_sets")
    human = root / "human"
    fragments = ROOT / "tests" / "data" / "hg38_fragments.fa.gz"
    argv = [
        "--fasta",
        str(fragments),
        "--seq",
        "128",
        "--heldout",
        "chr4:41257605-41263290",
        "--out",
        str(human),
    ]
    assert data_main([*argv, "--no-progress"]) == 0
    data = json.loads(demo_outputs[0].read_text())["provenance"]["data_dir"]
    assert eval_main([*demo_run(demo_outputs, root), "eval_windows=4", f"heldout={data},{human}"]) == 0
    return root / "demo" / "buckets.json"


@pytest.fixture
def notebook_env(monkeypatch, demo_outputs, copy_probe_json) -> None:
    buckets, metrics = demo_outputs
    monkeypatch.setenv("BUCKETS", str(buckets))
    monkeypatch.setenv("METRICS", str(metrics))
    monkeypatch.setenv("COPY_PROBE", str(copy_probe_json))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports genomelm even without an install


@pytest.mark.usefixtures("notebook_env")
def test_loss_by_position_notebook(tmp_path) -> None:
    nb = run_notebook("loss_by_position.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "run demo, 6 windows of 128 tokens, 8 buckets of 16" in text
    assert "checkpoints/step-0000004/model" in text and "context cut" in text
    assert "recomputed from windows.csv (equal to buckets.json)" in text and "± :" in text
    assert len(outputs(nb, "png")) == 3


@pytest.mark.usefixtures("notebook_env")
def test_loss_by_position_notebook_several_heldout_sets(tmp_path, monkeypatch, two_set_buckets) -> None:
    monkeypatch.setenv("BUCKETS", str(two_set_buckets))
    nb = run_notebook("loss_by_position.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "[data]: run demo, 4 windows of 128 tokens" in text and "[human]: run demo, 4 windows" in text
    assert "human: 4 windows" in text  # the side-by-side table
    assert text.count("(equal to buckets.json)") == 2
    assert len(outputs(nb, "png")) == 3


@pytest.mark.usefixtures("notebook_env")
def test_copy_probe_notebook(tmp_path) -> None:
    nb = run_notebook("copy_probe.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "run demo, 3 windows of 128 tokens, copies of 16 bases at 3 distances" in text
    assert "skipped 128: does not fit" in text and "checkpoints/step-0000004/model" in text
    assert len(outputs(nb, "png")) == 1


@pytest.mark.usefixtures("notebook_env")
def test_training_curves_notebook(tmp_path) -> None:
    nb = run_notebook("training_curves.ipynb", tmp_path)
    assert "4 steps (1..4), 0 skipped" in "".join(outputs(nb, "text"))
    assert len(outputs(nb, "png")) == 1


@pytest.mark.parametrize("name", ["loss_by_position.ipynb", "training_curves.ipynb", "copy_probe.ipynb"])
def test_committed_notebooks_have_no_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
