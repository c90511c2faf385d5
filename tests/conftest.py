"""Fixtures shared across test files."""

from __future__ import annotations

import os

# The Triton kernels' tests run them on CPU tensors in Triton's interpreter, which is chosen when triton is
# first imported: so before the imports below (torch._dynamo, via genomelm.train, imports triton)
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs a worker per core) each worker takes its share of the cores, so that
# torch's thread pools do not oversubscribe them; the ranks a test launches take theirs from this share too.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores)))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from genomelm.commands.data import main as data_main  # noqa: E402
from genomelm.commands.eval import main as eval_main  # noqa: E402
from genomelm.commands.train import main as train_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_outputs(tmp_path_factory) -> tuple[Path, Path]:
    """(buckets.json, metrics.jsonl) of a real, small run of the whole pipeline on the bundled fly genome:
    `genomelm data` -> `genomelm train` (tiny preset) -> `genomelm eval`, through the command-line entry
    points."""
    root = tmp_path_factory.mktemp("pipeline")
    data = root / "data"
    assert (
        data_main(
            [
                f"fasta={ROOT / 'data' / 'dmel_chr4.fa.gz'}",
                "genome=demo",
                "seq=128",
                "train=NC_004353.4:1-8192",
                "heldout=NC_004353.4:1000001-1000768",
                f"out={data}",
                "progress=false",
            ]
        )
        == 0
    )
    run = [
        f"data={data}",
        "seq=128",
        "model=tiny",
        "run=demo",
        f"runs_dir={root / 'runs'}",
        f"results_dir={root / 'results'}",
        "steps=4",
        "save_every=4",
        "warmup_steps=1",
        "lr=3e-3",
        "wandb=disabled",
        "bucket=16",
    ]
    assert train_main(run) == 0
    assert eval_main(run) == 0
    return root / "results" / "demo" / "buckets.json", root / "runs" / "demo" / "metrics.jsonl"
