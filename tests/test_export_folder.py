"""`genomelm export` of a one-process run: a folder that transformers' Auto classes load (config, model,
tokenizer) and that reproduces genomelm's own per-token losses, with its model card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genomelm.cli import main as cli_main
from genomelm.data.vocab import CODE_TABLE
from genomelm.model import load_model
from genomelm.parallel.checkpoint import Checkpointer
from genomelm.parallel.export import ExportError
from genomelm.run.hf_folder import VISION_FILE, export_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(demo_outputs) -> Path:
    """The session's small real run (`demo_outputs`: data -> train tiny 4 steps -> eval)."""
    buckets, metrics = demo_outputs
    return metrics.parent


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "demo-hf"
    assert cli_main(["export", str(run_dir), str(out), "dtype=fp32"]) == 0
    return out


def heldout_bases(length: int) -> str:
    """Real fly DNA from the run's held-out region (NC_004353.4 from 1,000,001), soft-mask kept."""
    import gzip

    from Bio import SeqIO

    with gzip.open(ROOT / "data" / "dmel_chr4.fa.gz", "rt") as handle:
        return str(next(SeqIO.parse(handle, "fasta")).seq[1_000_000 : 1_000_000 + length])


def test_auto_classes_load_the_folder_and_reproduce_genomelms_losses(run_dir, exported):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(exported)
    assert config.model_type == "glm5_next" and config.text_config.use_cache is False
    model, info = AutoModelForImageTextToText.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == "Glm5NextForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]  # the vision tower is in the folder
    assert all(not p.any() for name, p in model.named_parameters() if ".visual." in f".{name}")
    tokenizer = AutoTokenizer.from_pretrained(exported)

    bases = heldout_bases(128)  # one window of the run (seq=128), with soft-masked (lower-case) bases
    assert any(b.islower() for b in bases)
    ids = tokenizer(bases, return_tensors="pt").input_ids
    codes = CODE_TABLE[list(bases.encode())]  # the data stage's encoding (built-in ids: code = id)
    assert ids[0].tolist() == codes.tolist()
    assert tokenizer.decode(ids[0]) == bases.upper()

    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[:, :-1].float()
    theirs = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    step = Checkpointer(run_dir).complete()[-1]
    ours = -load_model(step / "model").eval().token_logprobs(ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert 0.5 < ours.mean() < 3.0  # a live model: not uniform over 8 ids, not perfect


def test_the_folder_holds_tokenizer_defaults_and_a_card(run_dir, exported, demo_outputs):
    names = sorted(p.name for p in exported.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        VISION_FILE,
    ]
    config = json.loads((exported / "config.json").read_text())
    assert config["text_config"]["bos_token_id"] is None and config["text_config"]["pad_token_id"] == 0
    assert json.loads((exported / "tokenizer_config.json").read_text())["pad_token"] == "<pad>"
    card = (exported / "README.md").read_text()
    manifest = json.loads(
        (
            Path(json.loads(demo_outputs[0].read_text())["provenance"]["data_dir"]) / "manifest.json"
        ).read_text()
    )
    buckets = json.loads(demo_outputs[0].read_text())
    assert card.startswith("---\nlibrary_name: transformers\nlicense: apache-2.0\n")
    assert manifest["fingerprint"] in card and manifest["sources"][0]["md5"] in card
    assert manifest["checksums"]["files"]["heldout.bin"]["blocks"][0] in card
    assert "NC_004353.4:1000001-1000768" in card  # the held-out split
    overall = buckets["overall"]
    interval = overall["intervals"]["change"]
    half = 100 * (interval["high"] - interval["low"]) / 2
    assert (
        f"| all | {overall['tokens']:,} | {overall['windows']} | {overall['loss_before']:.4f} | "
        f"{overall['loss_after']:.4f} | {100 * overall['change']:+.2f} ± {half:.2f}%"
    ) in card
    assert "AutoModelForImageTextToText.from_pretrained" in card and "vision.safetensors" in card
    assert "lr: 0.003" in card  # the settings as the run resolved them


def test_export_refuses_a_taken_folder_and_a_bad_setting(run_dir, exported, tmp_path, capsys):
    assert cli_main(["export", str(run_dir), str(exported)]) == 2
    assert "force=true" in capsys.readouterr().err
    assert cli_main(["export", str(run_dir), str(tmp_path / "x"), "dtype=fp16"]) == 2
    assert "dtype=fp16: give bf16 or fp32" in capsys.readouterr().err
    assert cli_main(["export", str(run_dir)]) == 2
    assert not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="holds no complete checkpoint"):
        export_run(tmp_path, tmp_path / "y")


def test_old_flags_still_work_with_a_deprecation_line(run_dir, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert cli_main(["export", str(run_dir), str(out), "--dtype", "bf16", "--max-shard-bytes=20000"]) == 0
    err = capsys.readouterr().err
    assert "--dtype is deprecated; write dtype=bf16" in err
    assert "--max-shard-bytes is deprecated; write max_shard_bytes=20000" in err
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
