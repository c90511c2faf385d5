"""The Python API, `genomelm.load(run_or_folder)`: per-base scores, embeddings and variant effects equal to
what the commands compute on the session's small real run (`demo_outputs`)."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import genomelm
from genomelm.commands.variants import main as variants_main
from genomelm.data.dataset import WindowDataset
from genomelm.data.vocab import CODE_TABLE
from genomelm.eval.embed import EmbedError
from genomelm.run.hf_folder import export_run
from genomelm.run.scoring import token_losses

ROOT = Path(__file__).resolve().parents[1]
FLY = ROOT / "data" / "dmel_chr4.fa.gz"
RECORD = "NC_004353.4"


def fly_bases() -> str:
    from Bio import SeqIO

    with gzip.open(FLY, "rt") as handle:
        return str(next(SeqIO.parse(handle, "fasta")).seq)


@pytest.fixture(scope="module")
def run(demo_outputs) -> tuple[Path, list[str]]:
    """The run folder and the settings it was trained with (`demo_outputs`)."""
    buckets, metrics = demo_outputs
    settings = json.loads(buckets.read_text())["provenance"]
    return metrics.parent, settings


@pytest.fixture(scope="module")
def model(run) -> genomelm.api.GenomeModel:
    return genomelm.load(run[0], progress=False)


def test_score_of_a_sequence_is_the_models_loss_per_base(model) -> None:
    bases = fly_bases()[1_000_000:1_000_100]
    bases = bases[:40] + "NN" + bases[42:]
    loss = model.score(bases)
    ids = torch.zeros(1, model.seq, dtype=torch.long)  # one window, right-padded, as the API reads it
    ids[0, :100] = torch.from_numpy(CODE_TABLE[list(bases.encode())].astype(np.int64))
    want = -model.model.token_logprobs(ids)[0, :99].numpy()  # base i + 1 given bases 0..i
    assert loss.shape == (100,) and np.isnan(loss[[0, 40, 41]]).all()
    keep = ~np.isnan(loss[1:])
    np.testing.assert_allclose(loss[1:][keep], want[keep], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="base 3: 'X' is no base"):
        model.score("ACXGT")


def test_score_of_a_region_is_what_eval_scores_on_the_heldout_window(model, run) -> None:
    """Region 1,000,002-1,000,128 (1-based): its first window reads the bases of held-out window 0 (from
    1,000,001), so its losses are the evaluator's per-token losses of that window."""
    loss = model.score(f"{RECORD}:1000002-1000128")
    window = WindowDataset(model.settings.data_dir, "heldout")[0]
    with torch.no_grad():
        want = token_losses(model.model, window, "fp32")
    valid = (window.labels != -100).numpy()[:127]  # the last position predicts nothing in the window
    np.testing.assert_allclose(loss[valid], want[:127][valid], rtol=0, atol=1e-6)
    assert valid.sum() > 100
    longer = model.score(f"{RECORD}:1000002-1000400", fasta=str(FLY))  # 4 windows, the given reference
    np.testing.assert_array_equal(longer[:127], loss)
    assert longer.shape == (399,) and not np.isnan(longer).any()


def test_embed_pools_the_base_rows(model) -> None:
    region = f"{RECORD}:1000001-1000300"
    rows = model.embed(region, pool="base")
    mean = model.embed(region)
    assert rows.shape == (300, model.model.config.hidden_size)
    letters = fly_bases()[1_000_000:1_000_300].upper()
    real = np.array([b in "ACGT" for b in letters])
    np.testing.assert_allclose(mean, rows[real].mean(0), rtol=1e-5, atol=1e-6)
    first = model.embed(region, layer=0)
    assert first.shape == mean.shape and not np.allclose(first, mean)
    with pytest.raises(EmbedError, match="embed_layer=9"):
        model.embed(region, layer=9)


def test_score_variants_equals_genomelm_variants(model, run, tmp_path, monkeypatch) -> None:
    bases = fly_bases()
    lines = []
    for pos in (1_000_200, 1_000_250):
        ref = bases[pos - 1].upper()
        lines.append(f"{RECORD}\t{pos}\t.\t{ref}\t{'G' if ref != 'G' else 'T'}\t.\t.\t.\n")
    vcf = tmp_path / "v.vcf"
    vcf.write_text("##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n" + "".join(lines))
    rows = model.score_variants(vcf)
    assert [(r["pos"], r["status"]) for r in rows] == [(1_000_200, ""), (1_000_250, "")]

    run_dir, _ = run
    settings = [
        f"data={model.settings.data_dir}",
        "seq=128",
        "model=tiny",
        "run=demo",
        f"runs_dir={run_dir.parent}",
        f"results_dir={tmp_path / 'results'}",
        f"vcf={vcf}",
    ]
    assert variants_main(settings) == 0
    with open(tmp_path / "results" / "demo" / "variants.tsv") as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    for row, want in zip(rows, table, strict=True):
        assert row["llr"] == pytest.approx(float(want["llr_after"]), abs=1e-5)
    assert rows[0]["llr"] != 0.0


def test_an_exported_folder_scores_as_the_run(model, run, tmp_path) -> None:
    folder = tmp_path / "hf"
    export_run(run[0], folder, dtype=torch.float32)
    exported = genomelm.load(folder, progress=False)
    assert exported.seq == model.seq and exported.vocab.code_to_id == model.vocab.code_to_id
    region = f"{RECORD}:1000002-1000300"
    np.testing.assert_allclose(exported.score(region, fasta=str(FLY)), model.score(region), atol=1e-5)
    with pytest.raises(ValueError, match="give fasta=FILE"):
        exported.score(region)


def test_the_using_the_model_notebook(run, tmp_path, monkeypatch) -> None:
    import nbformat
    from test_notebooks import outputs, run_notebook

    monkeypatch.setenv("RUN", str(run[0]))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports genomelm even without an install
    nb = run_notebook("using_the_model.ipynb", tmp_path)
    text = "".join(outputs(nb, "text"))
    assert "NC_004353.4:1000001-1001000: " in text and "over 1,000 bases" in text
    assert "embedding (32,), per base (1000, 32)" in text and "transformers: " in text
    committed = nbformat.read(ROOT / "notebooks" / "using_the_model.ipynb", as_version=4)
    assert all(not c.outputs and c.execution_count is None for c in committed.cells if c.cell_type == "code")
