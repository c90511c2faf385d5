"""`genomelm embed`: a layer's states as the head reads them, pooled over real bases or per base, written as
safetensors (+ index) and read back as a `datasets.Dataset`; regions of the reference; bad inputs; cp=2."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_fixtures import DMEL, DMEL_RECORD, fly_windows, read_records, tiny_run
from safetensors import safe_open

from genomelm.cli import main as cli_main
from genomelm.commands.train import main as train_main
from genomelm.data import WindowDataset
from genomelm.eval.embed import as_hf_dataset
from genomelm.model import GlmForCausalLM, ModelConfig, load_model
from genomelm.model.mhc import hc_head

FLY = read_records(DMEL)[DMEL_RECORD]
CODE = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
SEQ = 512
# 0-based [1199800, 1200824): two held-out windows, the second with the 162 N bases before 1200824 (the
# chromosome's one N run starts at 1200662)
HELDOUT = "1199801-1200824"
N_RUN = 1_200_662
LAYERS = 4  # the tiny preset's decoder layers


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A tiny run trained for 2 steps on fly windows of 512 tokens: its settings (without results_dir), its
    prepared folder and its before / after models."""
    root = tmp_path_factory.mktemp("embed")
    fly = fly_windows(root / "fly", "1-4096", SEQ, heldout=HELDOUT)
    settings = tiny_run(fly, root / "runs")
    assert train_main(settings) == 0
    runs = root / "runs" / "r"
    return {
        "settings": settings,
        "data": fly,
        "before": runs / "init",
        "after": runs / "checkpoints" / "step-0000002" / "model",
    }


def ids_of(letters: str) -> torch.Tensor:
    """Built-in token ids of sequence text, right-padded with 0 to SEQ."""
    ids = torch.zeros(SEQ, dtype=torch.long)
    ids[: len(letters)] = torch.tensor([CODE[c] for c in letters.upper()])
    return ids


def states(model: GlmForCausalLM, ids: torch.Tensor, layer: int | None = None) -> torch.Tensor:
    """The model's own states of one window [S] -> [S, D]."""
    with torch.no_grad():
        return model.hidden_states(ids[None], upto_layer=layer)[0]


def embed(run: dict, results: Path, *settings: str) -> Path:
    """`genomelm embed` through the command line; the folder it wrote."""
    assert cli_main(["embed", *run["settings"], f"results_dir={results}", *settings]) == 0
    return results / "r" / "embeddings"


def read(folder: Path) -> tuple[dict[str, torch.Tensor], dict, list[dict]]:
    """Every tensor of embeddings.safetensors, its metadata and its items."""
    with safe_open(folder / "embeddings.safetensors", "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors, metadata, json.loads(metadata["items"])


def test_upto_layer_is_that_layers_streams_collapsed_as_the_head_reads_them() -> None:
    torch.manual_seed(0)
    model = GlmForCausalLM.from_config(ModelConfig.preset("tiny")).eval()
    ids = torch.randint(1, 5, (2, 128))
    outputs, ran = [], []

    def runner(layer, streams, selection):
        result = layer(streams, selection)
        outputs.append(result[0])
        return result

    def counting(layer, streams, selection):
        ran.append(layer.layer_idx)
        return layer(streams, selection)

    with torch.no_grad():
        last = model.hidden_states(ids, runner)
        for k in range(LAYERS):
            assert torch.equal(model.hidden_states(ids, upto_layer=k), model.norm(hc_head(outputs[k])))
        assert torch.equal(model.hidden_states(ids, upto_layer=LAYERS - 1), last)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        assert torch.equal(
            model.lm_head(last, labels), model(ids, labels, reduction="none")
        )  # the head's input
        model.hidden_states(ids, counting, upto_layer=1)
        assert ran == [0, 1]  # the layers after it do not run
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.hidden_states(ids, upto_layer=2).dtype == torch.float32
    with pytest.raises(ValueError, match=r"upto_layer=4: the model has 4 decoder layers, 0\.\.3"):
        model.hidden_states(ids, upto_layer=4)


def test_heldout_windows_mean_over_real_bases_of_the_after_model(run: dict, tmp_path: Path, capsys) -> None:
    folder = embed(run, tmp_path)
    out = capsys.readouterr().out
    assert "with the after model" in out and "layer 3 of 4 (embed_layer=-1)" in out
    tensors, metadata, items = read(folder)
    assert list(tensors) == ["embedding"] and tensors["embedding"].dtype == torch.float32
    assert metadata["model"] == str(run["after"]) and metadata["model_role"] == "after"
    assert (metadata["pool"], metadata["layer"], metadata["width"]) == ("mean", "3", "32")
    heldout = WindowDataset(run["data"], "heldout")
    assert len(items) == len(heldout) == 2
    model = load_model(str(run["after"])).eval()
    for i, item in enumerate(items):
        window = heldout[i]
        assert (item["record"], item["start"], item["end"], item["strand"]) == (
            window.record,
            window.start,
            window.end,
            "+",
        )
        real = (window.input_ids != 0) & (window.input_ids != 5)
        assert item["real_bases"] == int(real.sum()) and (item["tensor"], item["row"]) == ("embedding", i)
        hidden = states(model, window.input_ids)
        torch.testing.assert_close(tensors["embedding"][i], hidden[real].mean(0), rtol=1e-5, atol=1e-6)
    assert (items[0]["start"], items[1]["end"], items[1]["real_bases"]) == (1_199_800, 1_200_824, 512 - 162)
    with_n = states(model, heldout[1].input_ids).mean(0)
    assert (tensors["embedding"][1] - with_n).abs().max() > 1e-3  # the N bases are left out of the mean
    with open(folder / "embeddings.tsv", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    assert [(r["start"], r["end"], r["real_bases"]) for r in rows] == [
        ("1199800", "1200312", "512"),
        ("1200312", "1200824", "350"),
    ]
    dataset = as_hf_dataset(folder, cache_dir=str(tmp_path / "hf"))
    assert dataset.column_names == ["record", "start", "end", "strand", "embedding"] and len(dataset) == 2
    assert dataset[1]["start"] == 1_200_312 and dataset[1]["record"] == DMEL_RECORD
    torch.testing.assert_close(torch.tensor(dataset[1]["embedding"]), tensors["embedding"][1])


def test_before_model_an_inner_layer_and_bf16(run: dict, tmp_path: Path, capsys) -> None:
    folder = embed(run, tmp_path, "embed_layer=-3", "embed_dtype=bf16", "--before", str(run["before"]))
    tensors, metadata, _ = read(folder)
    assert (metadata["model_role"], metadata["layer"], metadata["dtype"]) == ("before", "1", "bf16")
    assert tensors["embedding"].dtype == torch.bfloat16
    model = load_model(str(run["before"])).eval()
    window = WindowDataset(run["data"], "heldout")[1]
    real = (window.input_ids != 0) & (window.input_ids != 5)
    want = states(model, window.input_ids, layer=1)[real].mean(0)
    assert not torch.allclose(want, states(model, window.input_ids)[real].mean(0), atol=1e-3)
    torch.testing.assert_close(tensors["embedding"][1], want.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert "with the before model" in capsys.readouterr().out


def test_regions_per_base_and_mean(run: dict, tmp_path: Path) -> None:
    """A region of 700 bases: two windows from its start, the second right-padded; its N bases have states,
    its padding has none. A BED file: one item per line, mean over each region's real bases."""
    start, end = 1_200_000, 1_200_700  # the N run starts at offset 662
    letters = FLY[start:end]
    stale = tmp_path / "r" / "embeddings" / ".embeddings.part-999999999-0a.safetensors"  # a killed run's
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    region = f"{DMEL_RECORD}:{start + 1}-{end}"
    folder = embed(run, tmp_path, f"region={region}", "embed_pool=base")
    tensors, metadata, items = read(folder)
    assert list(tensors) == ["embedding.0"] and tensors["embedding.0"].shape == (700, 32)
    assert (items[0]["start"], items[0]["end"], items[0]["real_bases"]) == (start, end, 662)
    assert (items[0]["origin"], metadata["region"], metadata["pool"]) == (region, region, "base")
    assert not list(folder.glob(".embeddings.part-*"))  # moved into the set; the stale one removed
    model = load_model(str(run["after"])).eval()
    want = torch.cat(
        [states(model, ids_of(letters[:SEQ])), states(model, ids_of(letters[SEQ:]))[: 700 - SEQ]]
    )
    torch.testing.assert_close(tensors["embedding.0"], want, rtol=1e-5, atol=1e-6)
    dataset = as_hf_dataset(folder, cache_dir=str(tmp_path / "hf"))
    assert torch.tensor(dataset[0]["embedding"]).shape == (700, 32) and dataset[0]["end"] == end

    bed = tmp_path / "regions.bed"
    bed.write_text(f"track name=x\n{DMEL_RECORD}\t{start}\t{end}\n{DMEL_RECORD}\t5000\t5300\n")
    tensors, _, items = read(embed(run, tmp_path, f"region={bed}"))
    assert tensors["embedding"].shape == (2, 32)
    assert [(i["start"], i["end"], i["origin"]) for i in items] == [
        (start, end, f"{bed} line 2"),
        (5000, 5300, f"{bed} line 3"),
    ]
    real = torch.tensor([c != "N" for c in letters.upper()])
    torch.testing.assert_close(tensors["embedding"][0], want[real].mean(0), rtol=1e-5, atol=1e-6)
    short = states(model, ids_of(FLY[5000:5300]))[:300].mean(0)
    torch.testing.assert_close(tensors["embedding"][1], short, rtol=1e-5, atol=1e-6)


def test_per_base_bf16(run: dict, tmp_path: Path) -> None:
    folder = embed(run, tmp_path, f"region={DMEL_RECORD}:5001-5300", "embed_pool=base", "embed_dtype=bf16")
    tensors, _, _ = read(folder)
    assert tensors["embedding.0"].dtype == torch.bfloat16 and tensors["embedding.0"].shape == (300, 32)
    model = load_model(str(run["after"])).eval()
    want = states(model, ids_of(FLY[5000:5300]))[:300]
    assert torch.equal(tensors["embedding.0"], want.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["embed_layer=4"], r"embed_layer=4: the model .* has 4 decoder layers; give 0\.\.3 or -4\.\.-1"),
        (["embed_layer=-5", "embed_pool=base"], r"embed_layer=-5: .* give 0\.\.3 or -4\.\.-1"),
        (
            [f"region={DMEL_RECORD}:1348001-1349000"],
            rf"ends at base 1,349,000 but record {DMEL_RECORD} has 1,348,131 bases; give an end <= 1,348,131",
        ),
        (["region=chrX:1-100", "embed_pool=base"], r"no record 'chrX' in the run's reference .*dmel_chr4"),
        ([f"region={DMEL_RECORD}:0-10"], r"start must be >= 1"),
        (["--before", "a", "--after", "b"], r"--after PATH or --before PATH, not both"),
        (["embed_pool=max"], r"embed_pool"),
        (["seq=256"], r"held-out windows of .*fly are 512 tokens, not seq=256; give seq=512"),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_written(
    run: dict, tmp_path: Path, capsys, settings: list[str], message: str
) -> None:
    assert cli_main(["embed", *run["settings"], f"results_dir={tmp_path}", *settings]) == 2
    err = capsys.readouterr().err
    assert err.startswith("genomelm embed: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "r").exists()


def test_a_region_of_an_all_n_stretch_is_refused_for_mean_pooling(run: dict, tmp_path: Path, capsys) -> None:
    region = f"{DMEL_RECORD}:{N_RUN + 101}-{N_RUN + 200}"
    assert cli_main(["embed", *run["settings"], f"results_dir={tmp_path}", f"region={region}"]) == 2
    assert "no A/C/G/T base (all N) to average over" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert (embed(run, tmp_path, f"region={region}", "embed_pool=base") / "embeddings.tsv").exists()


@pytest.mark.slow
def test_cp2_and_dp2_equal_one_process(run: dict, tmp_path: Path) -> None:
    """A region of 3 windows, per base: at cp=2 a cp group's rank 0 receives each window's states; at dp=2 two
    replicas write their windows into the one file, also as ranks torchrun started. All as one process,
    through `genomelm embed`'s own launch (each in a fresh interpreter, as `make embed` runs it)."""
    region = f"region={DMEL_RECORD}:100001-101300"
    results = {}
    # --standalone: a rendezvous on a free port (another test may run torchrun at the same time)
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    for name, launch, mesh in (
        ("one", [sys.executable], []),
        ("cp2", [sys.executable], ["cp=2"]),
        ("dp2", [sys.executable], ["dp=2"]),
        ("torchrun-dp2", torchrun, ["dp=2", "launcher=env"]),  # rank 0 lays the file out for both
    ):
        command = [*launch, "-m", "genomelm.cli", "embed", *run["settings"], region, "embed_pool=base"]
        command += [f"results_dir={tmp_path / name}", *mesh]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        results[name] = read(tmp_path / name / "r" / "embeddings")
    one = results["one"][0]["embedding.0"]
    assert one.shape == (1300, 32)
    for name in ("cp2", "dp2", "torchrun-dp2"):
        tensors, _, items = results[name]
        assert items == results["one"][2]
        torch.testing.assert_close(tensors["embedding.0"], one, rtol=1e-5, atol=1e-5)
